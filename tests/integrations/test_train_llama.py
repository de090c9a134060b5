"""``qshard train --model llama``: transformers' Llama in the training application, end to end on
2 ranks (2 emulated nodes, ZeRO++ all + AdamW8bit): the loss falls, a resume replays the
uninterrupted run bit for bit, the export names the Llama's shape; and the refusals when
transformers is missing."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch.distributed as dist

from qshard.testing import run_world
from qshard.train import _parallel, llama
from qshard.train.config import TrainConfig
from tests.train.test_train_e2e import TINY, _corpus_file

pytest.importorskip("transformers", reason="needs transformers: pip install -e '.[dev]'")


def _config(tmp: Path, **kw) -> TrainConfig:
    return TrainConfig(
        **TINY,
        model="llama",
        nproc=2,
        ranks_per_node=1,
        data=str(tmp / "corpus.txt"),
        cache_dir=str(tmp / "cache"),
        steps=4,
        checkpoint_interval=2,
        keep_checkpoints=5,
        **kw,
    )


def _world(rank: int, world: int, tmp: str) -> dict:
    from qshard.train.loop import train

    tmp = Path(tmp)
    cfg = _config(tmp)
    full = train(cfg.replace(out=str(tmp / "full")))
    if rank == 0:
        shutil.copytree(
            tmp / "full/checkpoints/step_00000002", tmp / "resumed/checkpoints/step_00000002"
        )
    dist.barrier()
    resumed = train(cfg.replace(out=str(tmp / "resumed"), resume=True, export=False))
    return {
        "full": full["losses"],
        "resumed": resumed["losses"],
        "num_params": full["num_params"],
        "export": full["export"],
    }


def test_llama_trains_resumes_and_exports(tmp_path):
    _corpus_file(tmp_path)
    r = run_world(_world, 2, args=(str(tmp_path),), timeout_s=420)[0]
    assert r["full"][3] < r["full"][0]
    assert r["resumed"] == {s: r["full"][s] for s in (2, 3)}
    from safetensors import safe_open

    with safe_open(r["export"], "pt") as f:
        meta = json.loads(f.metadata()["llama_config"])
        names = list(f.keys())
    assert meta["n_kv_head"] == 1 and meta["n_head"] == 2  # grouped-query attention
    assert any(n.endswith("self_attn.k_proj.weight") for n in names)
    # --out/hf loads as transformers' own save_pretrained output: the wrapped model's names
    # (they had an "hf." prefix), its config.json, "format": "pt" (it refused the file before).
    from safetensors.torch import load_file
    from transformers import LlamaForCausalLM

    assert Path(r["export"]) == tmp_path / "full/hf/model.safetensors"
    hf, info = LlamaForCausalLM.from_pretrained(tmp_path / "full/hf", output_loading_info=True)
    assert not any(info.values()), info  # no missing, unexpected or mismatched keys
    saved = load_file(r["export"])
    state = hf.state_dict()
    assert set(saved) == set(state) - {k for k in state if k.endswith("rotary_emb.inv_freq")}
    assert all(state[k].equal(v) for k, v in saved.items())
    assert hf.config.num_key_value_heads == 1 and hf.config.num_hidden_layers == meta["n_layer"]
    # the keys save_pretrained adds, which tools that pick the model class read (they were
    # missing), and its generation config
    written = json.loads((tmp_path / "full/hf/config.json").read_text())
    assert written["architectures"] == ["LlamaForCausalLM"] and written["dtype"] == "float32"
    assert (tmp_path / "full/hf/generation_config.json").is_file()
    summary = (tmp_path / "full/summary.txt").read_text()
    assert "=== qshard train summary ===" in summary


def test_llama_model_is_the_transformers_llama():
    from qshard.train.loop import model_of

    cfg = TrainConfig(model="llama", n_layer=2, n_head=4, n_embd=64, context=32)
    model = model_of(cfg)
    hf = model.hf.config
    assert (hf.num_hidden_layers, hf.hidden_size, hf.num_attention_heads) == (2, 64, 4)
    assert hf.num_key_value_heads == 2 and hf.hidden_act == "silu"
    assert type(model.hf.model.norm).__name__ == "LlamaRMSNorm"
    assert hf.intermediate_size == 176  # 8/3 * 64, rounded up to a multiple of 8
    # the same seed builds the same weights, without touching the global RNG
    again = model_of(cfg)
    assert all(a.equal(b) for a, b in zip(model.parameters(), again.parameters()))
    assert list(model.blocks) == list(model.hf.model.layers)


def test_llama_without_transformers_is_refused(monkeypatch):
    monkeypatch.setattr(_parallel, "transformers_missing", lambda: True)
    monkeypatch.setattr(llama, "transformers_missing", lambda: True)
    cfg = TrainConfig(model="llama")
    (problem,) = _parallel.missing_features(cfg)
    assert "--model llama needs transformers" in problem and "pip install transformers" in problem
    assert _parallel.missing_features(TrainConfig()) == []  # the default needs nothing optional
    with pytest.raises(ImportError, match="pip install transformers"):
        llama.Llama(llama.LlamaSpec())


def test_llama_refuses_stable_embedding():
    with pytest.raises(ValueError, match="drop it for --model llama"):
        TrainConfig(model="llama", stable_embedding=True)
