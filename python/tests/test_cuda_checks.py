"""The CUDA side's logic that needs no GPU: what `cuda_status` says, and
every refusal of a call on CUDA tensors, each naming its reason."""

import types

import pytest
import torch

import fairring
from fairring import _cuda, _native, _tensors

CUDA0, CUDA1 = torch.device("cuda", 0), torch.device("cuda", 1)
READY = (True, "ready")


def test_the_package_carries_the_device_calls():
    # `pip install ./python` builds the library with its `cuda` feature.
    assert _native.cuda_built()
    assert hasattr(_native.lib(), "fr_work_enqueue_wait")


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_without_a_device_cuda_is_unavailable_naming_why():
    assert not fairring.cuda_available()
    assert "torch sees no CUDA device" in fairring.cuda_status()


def test_a_library_without_device_calls_says_so(monkeypatch):
    monkeypatch.setattr(_native, "cuda_built", lambda: False)
    available, reason = _cuda.cuda_status()
    assert not available
    assert "`cuda` feature" in reason and "FAIRRING_CUDA" in reason


def test_refusals_name_their_reason():
    r = _cuda.refusal
    assert r("allreduce", [CUDA0], None, False, READY) is None
    assert r("allreduce", [CUDA0, CUDA0], 0, False, READY) is None
    mixed = r("allgather", [CUDA0, torch.device("cpu")], None, False, READY)
    assert "allgather" in mixed and "cpu and cuda" in mixed
    missing = r("broadcast", [CUDA0], None, False, (False, "no driver here"))
    assert "broadcast on CUDA tensors: no driver here" in missing
    two = r("allreduce", [CUDA0, CUDA1], None, False, READY)
    assert "devices [0, 1]" in two
    other = r("reduce_scatter", [CUDA1], 0, False, READY)
    assert "cuda:1" in other and "runs on cuda:0" in other
    captured = r("allreduce", [CUDA0], 0, True, READY)
    assert "captured into a graph" in captured
    # Unavailability comes before every other reason, capture last.
    assert "no driver" in r("x", [CUDA0, CUDA1], 0, True, (False, "no driver"))
    assert "runs on cuda:0" in r("x", [CUDA1], 0, True, READY)


def test_a_group_binds_to_the_device_of_its_first_call(monkeypatch):
    monkeypatch.setattr(_cuda, "cuda_status", lambda: READY)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    on = lambda d: types.SimpleNamespace(device=d)  # noqa: E731
    group = _cuda.GroupDevice()
    group.check("allreduce", [on(CUDA1)])
    assert group.index == 1
    group.check("allreduce", [on(CUDA1), on(CUDA1)])
    with pytest.raises(RuntimeError, match="runs on cuda:1"):
        group.check("broadcast", [on(CUDA0)])
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(RuntimeError, match="captured into a graph"):
        group.check("allreduce", [on(CUDA1)])


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a CUDA device")
def test_a_group_refuses_cuda_tensors_where_none_can_run():
    group = _cuda.GroupDevice()
    with pytest.raises(RuntimeError, match="torch sees no CUDA device"):
        group.check("allreduce", [types.SimpleNamespace(device=CUDA0)])
    assert group.index is None


def test_only_cuda_tensors_take_the_device_path():
    cpu = torch.zeros(2)
    assert not _cuda.any_cuda([cpu, [cpu, (cpu,)], []])
    assert not _cuda.any_cuda([torch.zeros(2, device="meta")])


def test_tensors_of_other_devices_are_refused_naming_the_device():
    with pytest.raises(RuntimeError, match="meta tensor.*CPU and CUDA"):
        _tensors._host(torch.zeros(2, device="meta"), "allreduce")


def test_importing_fairring_leaves_cuda_module_loading_to_the_user():
    # The engine makes no CUDA call on its progress path, so lazy loading
    # (torch's default, which starts faster and holds less device memory) is
    # safe while streams wait for it: the package must not change the mode,
    # in a fresh process as a job starts.
    import os
    import subprocess
    import sys

    show = "import os, fairring; print(os.environ.get('CUDA_MODULE_LOADING'))"
    for given in [None, "LAZY", "EAGER"]:
        env = {k: v for k, v in os.environ.items() if k != "CUDA_MODULE_LOADING"}
        if given is not None:
            env["CUDA_MODULE_LOADING"] = given
        out = subprocess.run(
            [sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True
        )
        assert out.stdout.strip() == str(given), (given, out.stdout, out.stderr)
