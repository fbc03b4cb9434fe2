"""The CNN classifier of ``examples.cnn_classifier`` in plain fp32, through the very same
training step: only two flags change, ``autocast(enabled=False)`` and
``GradScaler(enabled=False)``, which turn every AMP call in the step into a
pass-through. One code path for both precisions makes the fp32 run a true baseline for
the AMP one (same data, seed, model and step).

    UNIFIED_AMP_BACKEND=megengine python -m examples.fp32_baseline
"""

from __future__ import annotations

from typing import Any

import unified_amp as amp

from . import cnn_classifier


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Trains the CNN classifier in fp32; takes cnn_classifier's options but --demo and
    --dtype.

    Returns:
        ``cnn_classifier.train()``'s result.
    """
    args = cnn_classifier.parse_args(argv, description=__doc__, amp_options=False)
    result = cnn_classifier.train(
        amp_enabled=False, epochs=args.epochs, batch_size=args.batch_size,
        train_size=args.train_size, width=args.width, lr=args.lr, seed=args.seed,
        progress=not args.no_progress)
    print(f"CNN classifier on {amp.get_backend().name}, fp32 through the AMP training step")
    cnn_classifier.print_table({"fp32": result})
    return result


if __name__ == "__main__":
    main()
