"""autocast on the real backends: where it applies, nesting, defaults, failures."""

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import unified_amp as amp

from .dtype_table import inputs

DEFAULT_LOW = {("torch", "cpu"): "bfloat16", ("torch", "cuda"): "float16",
               ("megengine", "cpu"): "float16", ("megengine", "cuda"): "float16"}


def matmul_dtype(kit, device):
    out = kit.run_op("matmul", inputs(), device, "float16", "float32")
    assert np.all(np.isfinite(kit.numpy(out)))
    return kit.dtype_name(out)


def test_applies_where_the_tensors_live_without_naming_the_device(kit, device):
    # torch on a GPU machine: CUDA only, as torch.autocast("cuda") (docs/API.md, "Devices")
    cpu_left_alone = kit.name == "torch" and device == "cpu" and kit.has_cuda()
    with amp.autocast(dtype="float16"):
        assert matmul_dtype(kit, device) == ("float32" if cpu_left_alone else "float16")
        with amp.autocast(dtype="float16", device="cpu"):
            assert matmul_dtype(kit, device) == "float16"


def test_default_dtype_is_the_devices_fast_low_precision(kit, device):
    with amp.autocast(device=device):
        assert matmul_dtype(kit, device) == DEFAULT_LOW[(kit.name, device)]


def test_framework_dtype_objects_are_accepted(kit, device):
    with amp.autocast(dtype=kit.dtype_object("float16"), device=device):
        assert matmul_dtype(kit, device) == "float16"
    with pytest.raises(ValueError, match="must be one of 'float16', 'half'.*float16 or bfloat16"):
        amp.autocast(dtype=kit.dtype_object("float32"))


def test_nesting_restores_each_outer_state(kit, device):
    assert matmul_dtype(kit, device) == "float32"
    with amp.autocast(dtype="float16", device=device):
        with amp.autocast(enabled=False):
            with amp.autocast(dtype="float16", device=device):
                assert matmul_dtype(kit, device) == "float16"
            assert matmul_dtype(kit, device) == "float32"
        assert matmul_dtype(kit, device) == "float16"
    assert matmul_dtype(kit, device) == "float32"
    assert not amp.is_autocast_enabled()


def test_decorator_and_exception_safety(kit, device):
    @amp.autocast(dtype="float16", device=device)
    def step():
        assert amp.is_autocast_enabled()
        return matmul_dtype(kit, device)

    assert step() == "float16"
    assert not amp.is_autocast_enabled()
    with pytest.raises(ZeroDivisionError):
        with amp.autocast(dtype="float16", device=device):
            1 / 0
    assert matmul_dtype(kit, device) == "float32"


def test_native_call_forms_work_unchanged(kit, device):
    if kit.name == "torch":
        block = amp.autocast(device, dtype=kit.dtype_object("float16"))
    else:
        block = amp.autocast(True, low_prec_dtype="float16")
    with block:
        assert matmul_dtype(kit, device) == "float16"


def test_unsupported_precision_fails_on_entry_and_the_process_exits_cleanly(kit):
    """bfloat16 on MegEngine's CPU build must fail up front, not as an async error later
    or at exit; on torch/CPU it simply runs. Run in a fresh interpreter to see its exit."""
    code = textwrap.dedent(f"""
        import numpy as np, unified_amp as amp
        from tests.kits import load_kit
        from tests.contract.dtype_table import inputs
        kit = load_kit({kit.name!r})
        try:
            with amp.autocast(dtype="bfloat16", device="cpu"):
                out = kit.run_op("matmul", inputs(), "cpu", "bfloat16", "float32")
                kit.numpy(out)
            print("RAN", kit.dtype_name(out))
        except amp.UnsupportedPrecisionError as e:
            print("REFUSED", isinstance(e, RuntimeError))
        with amp.autocast(dtype="float16", device="cpu"):
            out = kit.run_op("matmul", inputs(), "cpu", "float16", "float32")
        print("AFTER", kit.dtype_name(out), bool(np.isfinite(kit.numpy(out)).all()))
    """)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    env = dict(os.environ, UNIFIED_AMP_BACKEND=kit.name, PYTHONPATH=root)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env=env, cwd=root, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "AsyncError" not in proc.stderr and "Traceback" not in proc.stderr
    lines = proc.stdout.split("\n")
    first = "REFUSED True" if kit.name == "megengine" else "RAN bfloat16"
    assert lines[0] == first and lines[1] == "AFTER float16 True", proc.stdout


@pytest.mark.parametrize("call", ["device='cuda'", "torch-style 'cuda'"])
def test_cuda_without_a_gpu_is_refused_on_entry(kit, call):
    """Where the framework sees no GPU (MegEngine's CUDA build on a CPU-only machine says
    so in its banner and runs on CPU), asking for CUDA raises the documented error when
    the block is entered, names the fix, and leaves autocast off and CPU work intact. On
    a GPU machine the same block simply runs."""
    block = amp.autocast(device="cuda", dtype="float16") if call == "device='cuda'" \
        else amp.autocast("cuda", dtype="float16")
    if kit.has_cuda():
        with block:
            assert matmul_dtype(kit, "cuda") == "float16"
        return
    with pytest.raises(amp.UnsupportedPrecisionError,
                       match=r"autocast\(device='cuda'\).*sees no CUDA device.*"
                             r"Use device='cpu' or device=None\.") as caught:
        with block:
            pytest.fail("the block ran without a GPU")
    assert isinstance(caught.value, RuntimeError)
    assert not amp.is_autocast_enabled()
    with kit.on_device("cpu"):
        assert matmul_dtype(kit, "cpu") == "float32"
        with amp.autocast(dtype="float16", device="cpu"):
            assert matmul_dtype(kit, "cpu") == "float16"
