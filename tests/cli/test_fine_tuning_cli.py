"""`hetrain simulate` / `hetrain plan` for fine-tuning: --lora RANK on a preset, --trainable-params N."""

from __future__ import annotations

import json

import pytest

from clirun import hetrain_here, one_line_error

CLUSTER = "a100-80g,rtx3090,rtx3090"


def simulate_json(*args):
    r = hetrain_here("simulate", "--cluster", CLUSTER, "--global-batch", "64", "--json", *args)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout)


def test_llama_8b_with_lora_fits_the_24gb_cards_where_full_training_fits_none():
    # full training fits only with the memory savers (optimizer state on host): without them, none
    one_line_error(hetrain_here("simulate", "--cluster", CLUSTER, "--model", "llama-8b", "--global-batch", "64",
                                "--offload", "none"), "no layout fits memory")
    data = simulate_json("--model", "llama-8b", "--lora", "16")
    assert data["model"]["trainable_params"] == 13_631_488
    assert data["plan"]["shares"][1] > 0 and data["plan"]["shares"][2] > 0       # the 3090s take part
    hetrain_row = data["strategies"][2]
    assert all(m["bytes"] <= m["cap"] for m in hetrain_row["memory_per_device"])
    # the preset and --trainable-params with the same count plan the same memory
    same = simulate_json("--model", "llama-8b-lora")
    assert same["strategies"][2]["memory_per_device"] == hetrain_row["memory_per_device"]
    r = hetrain_here("simulate", "--cluster", CLUSTER, "--model", "mistral-7b-lora", "--global-batch", "64")
    assert r.returncode == 0 and "LoRA rank 16 on q,k,v,o" in r.stdout, r.stderr


def test_trainable_params_with_given_numbers():
    full = simulate_json("--params", "1e9", "--flops-per-sample", "1e13", "--activation-bytes", "1GiB")
    ft = simulate_json("--params", "1e9", "--flops-per-sample", "1e13", "--activation-bytes", "1GiB",
                       "--trainable-params", "1e7")
    assert ft["model"]["trainable_params"] == 10_000_000
    # 16 GB of fp32 state become 2.1 GB: the 24 GB cards' micro-batches grow
    micro = [[d["micro_batch"] for d in x["plan"]["devices"]] for x in (full, ft)]
    assert all(m_ft > m_full for m_full, m_ft in zip(micro[0][1:], micro[1][1:])), micro


@pytest.mark.parametrize("args, words", [
    (("--params", "1e9", "--flops-per-sample", "1e13", "--activation-bytes", "1GiB", "--trainable-params", "2e9"),
     ("--trainable-params 2e9 is more than --params 1e9",)),
    (("--model", "llama-8b", "--trainable-params", "9e9"), ("more than its 8,030,261,248 parameters",)),
    (("--params", "1e9", "--flops-per-sample", "1e13", "--activation-bytes", "1GiB", "--lora", "16"),
     ("--lora 16 needs a model preset", "--trainable-params N")),
    (("--model", "resnet50", "--lora", "8"), ("not known", "--trainable-params")),
    (("--model", "llama-8b", "--lora", "0"), ("not a rank",)),
])
def test_bad_fine_tuning_input_is_one_line(args, words):
    one_line_error(hetrain_here("simulate", "--cluster", CLUSTER, "--global-batch", "64", *args), *words)
    one_line_error(hetrain_here("plan", "--emulate", CLUSTER, "--global-batch", "64", *args), *words)
