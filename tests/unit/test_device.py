"""Device, backend and thread choice."""

import pytest
import torch

from meshtrain.runtime.device import DeviceError, pick_backend, pick_device, threads_per_rank


def test_auto_is_cpu_on_a_machine_without_accelerators(monkeypatch):
    monkeypatch.delenv("MESHTRAIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert pick_device(local_rank=3) == torch.device("cpu")


def test_cuda_local_rank_picks_its_own_gpu_and_wraps_when_each_rank_sees_one(monkeypatch):
    monkeypatch.delenv("MESHTRAIN_DEVICE", raising=False)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert pick_device(local_rank=2) == torch.device("cuda", 2)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)  # CUDA_VISIBLE_DEVICES holds this rank's GPU only
    assert pick_device(local_rank=3) == torch.device("cuda", 0)


def test_environment_override(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_DEVICE", "cpu")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert pick_device(local_rank=1) == torch.device("cpu")


def test_asking_for_a_missing_accelerator_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(DeviceError, match="sees no cuda here"):
        pick_device(requested="cuda")
    with pytest.raises(DeviceError, match="unknown device 'tpu'"):
        pick_device(requested="tpu")


@pytest.mark.parametrize("device,backend", [("cpu", "gloo"), ("cuda:0", "nccl"), ("xpu:0", "xccl"), ("mps", "gloo")])
def test_backend_matches_device(monkeypatch, device, backend):
    monkeypatch.delenv("MESHTRAIN_BACKEND", raising=False)
    assert pick_backend(torch.device(device)) == backend


def test_backend_override_and_mismatch(monkeypatch):
    monkeypatch.setenv("MESHTRAIN_BACKEND", "gloo")
    assert pick_backend(torch.device("cuda:0")) == "gloo"
    with pytest.raises(DeviceError, match="nccl needs CUDA"):
        pick_backend(torch.device("cpu"), "nccl")
    with pytest.raises(DeviceError, match="unknown backend 'foo'"):
        pick_backend(torch.device("cpu"), "foo")


def test_threads_per_rank_shares_the_node(monkeypatch):
    monkeypatch.setattr("meshtrain.runtime.device.cpus_available", lambda: 64)
    assert threads_per_rank(4, environ={}) == 16
    assert threads_per_rank(128, environ={}) == 1
    assert threads_per_rank(4, environ={"OMP_NUM_THREADS": "3"}) == 3
