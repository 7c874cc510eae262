"""Memory truth on CUDA, pinned on the CPU with torch.cuda's readings replaced: capacity is what
this process can hold (free memory plus its allocator's reserve), peaks are reserved bytes, and
the first backward's gradients are not counted as activations."""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from hetrain.runtime.devices import cuda_memory
from hetrain.runtime.memory import device_memory

GIB = 2**30
SRC = Path(__file__).resolve().parents[4] / "src" / "hetrain"


def test_capacity_is_free_memory_plus_this_process_s_reserve(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 * GIB, 80 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 5 * GIB)
    assert cuda_memory.usable_bytes(torch.device("cuda", 0)) == 65 * GIB     # not the card's 80


def test_no_runtime_module_reads_the_card_s_total_as_its_capacity():
    readers = [str(p.relative_to(SRC)) for p in (SRC / "runtime").rglob("*.py")
               if ").total_memory" in p.read_text()]
    assert readers == []


def test_the_measured_peak_is_the_allocator_s_reserved_bytes(monkeypatch):
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * GIB)
    assert device_memory.measured_peak(torch.device("cuda", 0), None) == 5 * GIB


def test_activations_leave_out_the_gradients_the_first_backward_allocates(monkeypatch):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 1))
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    true_activations = 10_000         # more than the saved tensors the meter sees, as a GPU's temporaries are
    monkeypatch.setattr(torch.random, "fork_rng", lambda devices=(): contextlib.nullcontext())
    for name in ("synchronize", "reset_peak_memory_stats"):
        monkeypatch.setattr(torch.cuda, name, lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: true_activations + grads)
    saved = device_memory.saved_activation_bytes(
        model, torch.randn(4, 64), forward=lambda m, b: m(b).sum(), device=torch.device("cuda", 0),
        autocast=contextlib.nullcontext)
    assert saved == true_activations


def test_the_step_s_peak_the_loop_reports_is_reserved_bytes(monkeypatch):
    from hetrain.runtime.devices.hooks import CudaHooks

    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: 3 * GIB)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: 5 * GIB)
    hooks = CudaHooks(torch.device("cuda", 0))
    assert hooks.step_peak_bytes() == 5 * GIB and hooks.peak_bytes() == 5 * GIB
