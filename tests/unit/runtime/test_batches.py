"""Batches of every kind the tools hand over (a tokenizer's BatchEncoding, other UserDicts and
mappings, dataclasses, tuples and namedtuples, tensors) are moved, counted, cut and called on as
Accelerate and the Trainer do. Moves are checked onto 'meta', a device distinct from the host (as a
GPU is): a batch left where it was shows."""

from __future__ import annotations

import collections
import dataclasses

import pytest
import torch
from torch import nn
from transformers import BatchEncoding

from hetrain.runtime.user_objects import ForwardCallError, default_forward, rows, to_device

META = torch.device("meta")


@dataclasses.dataclass
class Pair:
    x: torch.Tensor
    y: torch.Tensor
    note: str = "kept"


Named = collections.namedtuple("Named", "x y")


def _encoding(n=5):
    return BatchEncoding({"input_ids": torch.arange(n * 3).view(n, 3), "attention_mask": torch.ones(n, 3)})


def _devices(batch):
    if isinstance(batch, torch.Tensor):
        return {batch.device}
    if dataclasses.is_dataclass(batch):
        batch = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    values = batch.values() if isinstance(batch, collections.abc.Mapping) else batch
    return set().union(*(_devices(v) for v in values if isinstance(v, (torch.Tensor, list, tuple, dict))))


@pytest.mark.parametrize("batch", [_encoding(), collections.UserDict({"x": torch.ones(5, 2)}),
                                   Pair(torch.ones(5, 2), torch.zeros(5)), Named(torch.ones(5, 2), torch.zeros(5)),
                                   {"a": [torch.ones(5), (torch.zeros(5, 1),)]}],
                         ids=["BatchEncoding", "UserDict", "dataclass", "namedtuple", "nested dict"])
def test_every_batch_kind_moves_to_the_device_keeping_its_type(batch):
    moved = to_device(batch, META)
    assert type(moved) is type(batch)
    assert _devices(moved if not isinstance(moved, collections.UserDict) else moved.data) == {META}
    if isinstance(batch, Pair):
        assert moved.note == "kept"


def test_a_batch_encoding_is_counted_as_one_batch():
    enc = _encoding(5)
    assert rows(enc) == 5 and rows(Pair(torch.ones(4, 2), torch.zeros(4))) == 4 and rows({"k": "v"}) is None


class KeywordModel(nn.Module):
    def forward(self, input_ids, attention_mask=None):
        return input_ids.float().sum(-1) * attention_mask.sum(-1)


def test_a_batch_encoding_is_called_with_its_keywords_as_the_trainer_calls_it():
    out = default_forward(KeywordModel(), _encoding(2))
    assert out.tolist() == [9.0, 36.0]


def test_a_model_hetrain_cannot_call_says_how_it_was_called_and_names_forward():
    class TwoInputs(nn.Module):
        def forward(self, x, target):
            return x

    with pytest.raises(ForwardCallError) as caught:
        default_forward(TwoInputs(), (torch.ones(2), torch.ones(2)))
    what, fix = caught.value.what, caught.value.fix
    assert "model(batch[0])" in what and "tuple batch" in what and "TypeError: " in what and "target" in what
    assert "forward=" in fix and "init(plan=" not in fix


def test_an_error_with_no_message_still_says_what_it_was():
    class Silent(nn.Module):
        def forward(self, x):
            raise AttributeError()

    with pytest.raises(ForwardCallError, match=r"AttributeError: \(no message\)"):
        default_forward(Silent(), torch.ones(2))


def test_the_trainers_token_count_reads_a_batch_encodings_labels():
    """DataCollatorWithPadding and tokenizer.pad give BatchEncodings: under token weighting their
    labels are counted, as a dict's are."""
    import types

    from hf_tiny import gpt2

    from hetrain.integrations.hf.trainer import Trainer

    trainer = Trainer.__new__(Trainer)            # only what token_counter reads
    trainer.model = gpt2()
    trainer.engine = types.SimpleNamespace(config=types.SimpleNamespace(loss_weighting="tokens"))
    labels = torch.tensor([[5, 6, -100, 7], [-100, 1, 2, 3]])
    assert trainer.token_counter()(BatchEncoding({"input_ids": labels.clamp(min=0), "labels": labels})) == 5     # each row from its second label
