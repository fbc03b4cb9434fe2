"""Examples of unified_amp: each trains on PyTorch or MegEngine (``UNIFIED_AMP_BACKEND``)
with one training step written once against unified_amp.

    python -m examples.cnn_classifier --demo     # what `make demo` runs
    python -m examples.gan
    python -m examples.grad_accumulation
    python -m examples.fp32_baseline
    python -m examples.apex_style --compare     # amp.initialize / scale_loss, O0-O3
    python -m examples.cifar --synthetic 960 --model resnet18 --width 8   # `make cifar`

What the frameworks spell differently (models, losses, optimizers, tensors) lives in
``examples.frameworks`` (the construction kit the tests and benchmarks build on too);
nothing else in this package imports a framework.
"""
