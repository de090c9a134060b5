"""Train a Hugging Face causal LM with qshard: a ``transformers`` Llama built from a config.

Nothing is downloaded: the model is ``LlamaForCausalLM(LlamaConfig(...))`` with random weights
(byte-level, vocabulary 256) and the text is the Python standard library's source. What a real
run would add is a tokenizer and ``from_pretrained``; the distributed part is the same:

* ``qshard.shard`` wraps every decoder layer, then the root (it finds the layers itself: the
  classes the model names in ``_no_split_modules``), with the ZeRO++ features of ``--zeropp``
  (or, with ``--zeropp hsdp``, HSDP: sharded inside a node, replicated across nodes)
  and a bf16 ``MixedPrecisionPolicy`` (fp32 gradient reduction);
* ``AdamW8bit`` (8-bit block-wise state) or ``ZeroOneAdam`` (1-bit compressed data parallel:
  the model then stays replicated and the optimizer communicates; bf16 through autocast);
* activation checkpointing (the model's own, non-reentrant), gradient accumulation (FSDP2
  reduces gradients once, on the last micro-batch; the weights gathered for the first
  micro-batch kept for the others, ``set_keep_weights_after_backward``), clipping on the global
  norm;
* ``--save-pretrained DIR``: the trained model for ``from_pretrained``, gathered on every rank
  and written by rank 0 (``save_pretrained`` on a sharded model alone would hang);
* a DCP checkpoint through ``torch.distributed.checkpoint.state_dict`` that loads on any
  number of ranks, and an exact resume. ZeroOneAdam's state is per rank (each rank's error
  buffers), so it is saved as one ``torch.save`` file per rank instead. Either is written
  beside the checkpoint and swapped in once complete: a killed save loses nothing.

Run it on one machine, 4 CPU ranks emulating 2 nodes of 2::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/hf_llama.py --ranks-per-node 2 \\
        --steps 20 --checkpoint /tmp/llama_ckpt
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/hf_llama.py --ranks-per-node 2 \\
        --steps 40 --checkpoint /tmp/llama_ckpt --resume

Needs ``transformers`` (in qshard's ``dev`` extra: ``pip install -e '.[dev]'``).
``tests/integrations/test_hf_llama.py`` runs these functions against plain FSDP2.
"""

from __future__ import annotations

import argparse
import os
import shutil
import sysconfig
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy
from torch.distributed.tensor import DTensor
from transformers import LlamaConfig, LlamaForCausalLM

from qshard.comm import Topology
from qshard.optim import AdamW8bit, ZeroOneAdam
from qshard.zeropp import ZeroPPConfig, set_keep_weights_after_backward, shard

BF16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)


def llama_config(
    *, hidden: int = 64, layers: int = 2, heads: int = 4, kv_heads: int = 2, context: int = 64
) -> LlamaConfig:
    """A small Llama (RoPE, grouped-query attention, RMSNorm, SwiGLU) over 256 byte tokens."""
    return LlamaConfig(
        vocab_size=256,
        hidden_size=hidden,
        intermediate_size=4 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=context,
        tie_word_embeddings=False,
        use_cache=False,
    )


def build_model(config: LlamaConfig, *, seed: int, device: torch.device) -> LlamaForCausalLM:
    """The model, initialized the same on every rank, with activation checkpointing on."""
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(device)
    kwargs = {"use_reentrant": False}  # non-reentrant: composes with FSDP2's hooks
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(kwargs)
    else:  # older transformers
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return model.train()


def parallelize(
    model: nn.Module, *, optim: str, topology: Topology, zeropp: ZeroPPConfig
) -> torch.optim.Optimizer:
    """Distribute ``model`` for ``optim`` and return the optimizer (lr is set per step)."""
    if optim != "zero_one_adam":  # ZeroOneAdam: every rank keeps the whole model
        shard(model, topology=topology, config=zeropp, mp_policy=BF16)
    # Matrices decay, RMSNorm gains do not; after shard() these are the sharded parameters.
    params = list(model.parameters())
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    cls = ZeroOneAdam if optim == "zero_one_adam" else AdamW8bit
    return cls(groups, lr=1e-3, betas=(0.9, 0.95))


ZEROPP_FEATURES = ("qwz", "hpz", "qgz")


def zeropp_config(spec: str) -> ZeroPPConfig:
    """``--zeropp``: ``off``, ``all`` (qwZ + hpZ + qgZ), ``hsdp``, or a comma list of
    :data:`ZEROPP_FEATURES` (case and spaces ignored). Anything else is refused naming the
    choices, as is a combination :class:`ZeroPPConfig` refuses; an argparse ``type=``, so
    every rank stops at its usage line before the process group starts."""
    names = [n.strip() for n in spec.lower().split(",")]
    if names == ["off"]:
        return ZeroPPConfig()
    if names == ["all"]:
        names = list(ZEROPP_FEATURES)
    unknown = [n for n in names if n not in (*ZEROPP_FEATURES, "hsdp")]
    if unknown:
        # [Note: --zeropp names] names went straight to ZeroPPConfig(**{name: True}): "qwx",
        # "qwz, hpz" (a space) or "" failed on every rank with "unexpected keyword argument",
        # and any other bool field of ZeroPPConfig ("record", "prefetch") was taken as a feature
        raise argparse.ArgumentTypeError(
            f"{spec!r}: {', '.join(repr(n) for n in unknown)} is not a ZeRO++ feature; pass "
            f"off, all, hsdp, or a comma list of {', '.join(ZEROPP_FEATURES)} (e.g. qwz,hpz)"
        )
    try:
        return ZeroPPConfig(**{name: True for name in names})
    except ValueError as e:  # e.g. hsdp,qwz: argparse would print only "invalid value"
        raise argparse.ArgumentTypeError(f"{spec!r}: {e}") from None


def corpus() -> torch.Tensor:
    """Byte tokens: a few standard-library modules (real text, no download)."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    names = ("json/decoder.py", "abc.py", "bisect.py", "textwrap.py", "string.py")
    data = b"".join((stdlib / n).read_bytes() for n in names)
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).long()


def micro_batches(
    tokens: torch.Tensor, *, step: int, rank: int, accum: int, batch: int, context: int
) -> list[torch.Tensor]:
    """This rank's ``accum`` micro-batches of ``step``: a pure function of (step, rank), so a
    resumed run sees the same data as an uninterrupted one."""
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    out = []
    for _ in range(accum):
        starts = torch.randint(0, tokens.numel() - context, (batch,), generator=g)
        out.append(torch.stack([tokens[s : s + context] for s in starts.tolist()]))
    return out


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    batches: list[torch.Tensor],
    *,
    lr: float,
    max_norm: float = 1.0,
    keep_weights: bool = False,
) -> tuple[float, float]:
    """One optimizer step over ``batches`` (gradient accumulation); returns this rank's mean
    loss and the gradient norm before clipping. ``keep_weights`` (a model ``shard()`` made
    ZeRO-3): the weights gathered for the first micro-batch's forward are kept for the others
    (``set_keep_weights_after_backward``: hpZ's node-local shards, the root; the same bits)."""
    sharded = isinstance(model, FSDPModule)
    device = next(model.parameters()).device
    total = 0.0
    for i, ids in enumerate(batches):
        if sharded:  # reduce-scatter once, after the last micro-batch
            model.set_requires_gradient_sync(i == len(batches) - 1)
        if keep_weights:  # off for the last backward: the step's clip reads the gradients
            set_keep_weights_after_backward(model, i < len(batches) - 1)
        ids = ids.to(device)
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=not sharded):
            loss = model(input_ids=ids, labels=ids).loss / len(batches)
        loss.backward()
        total += float(loss.detach())
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    if isinstance(norm, DTensor):
        norm = norm.full_tensor()
    for group in optimizer.param_groups:
        group["lr"] = lr
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return total, float(norm)


def save_pretrained(path: str, model: nn.Module) -> None:
    """Write ``model`` as ``transformers`` does (``config.json`` and ``model.safetensors``) for
    ``from_pretrained`` (collective). Every rank gathers the full weights (to rank 0's CPU) and
    rank 0 writes them: ``model.save_pretrained(path)`` on a sharded model would gather on rank 0
    alone, while the gather needs every rank (a hang). A forward under ``no_grad`` (an
    evaluation) leaves FSDP2's root unit unsharded in the compute dtype, and ``save_pretrained``
    records the dtype of the parameters it finds there (``bfloat16``, so ``from_pretrained``
    would cast the fp32 weights): ``reshard()`` first puts the fp32 shards back."""
    if isinstance(model, FSDPModule):
        model.reshard()
    sd = get_model_state_dict(
        model, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
    )
    if dist.get_rank() == 0:
        model.save_pretrained(path, state_dict=sd)
    dist.barrier()


def save_checkpoint(
    path: str, model: nn.Module, optimizer: torch.optim.Optimizer, *, step: int
) -> None:
    """Model, optimizer and step at ``path`` (collective). Written to ``path.saving`` and moved
    into place once every rank has finished, so a job killed while saving leaves the previous
    checkpoint whole (assumes ``path`` is on a file system all ranks share, as DCP does)."""
    rank = dist.get_rank()
    staging = f"{path}.saving"
    if rank == 0:
        shutil.rmtree(staging, ignore_errors=True)  # what a killed save left
    dist.barrier()
    if isinstance(optimizer, ZeroOneAdam):
        # Per-rank state (error buffers): one file per rank, loaded by the same rank.
        optimizer.synchronize()
        os.makedirs(staging, exist_ok=True)
        state = {"model": model.state_dict(), "optim": optimizer.state_dict(), "step": step}
        torch.save(state, os.path.join(staging, f"rank_{rank:05d}.pt"))
    else:
        model_sd, optim_sd = get_state_dict(model, optimizer)
        dcp.save({"model": model_sd, "optim": optim_sd, "step": step}, checkpoint_id=staging)
    dist.barrier()  # every rank's files are written
    if rank == 0:
        old = f"{path}.old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.exists(path):
            os.rename(path, old)
        os.rename(staging, path)
        shutil.rmtree(old, ignore_errors=True)
    dist.barrier()


def load_checkpoint(path: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """Load :func:`save_checkpoint`'s files into ``model`` and ``optimizer``; returns the step.
    A checkpoint of the other ``--optim`` (per-rank files vs DCP) is refused, saying which."""
    per_rank = os.path.join(path, f"rank_{dist.get_rank():05d}.pt")
    want = per_rank if isinstance(optimizer, ZeroOneAdam) else os.path.join(path, ".metadata")
    if not os.path.exists(want):
        # DCP's reader failed with "No such file ... .metadata" on a zero_one_adam checkpoint,
        # torch.load with a missing rank_*.pt on an adamw8bit one: say what is there instead
        names = os.listdir(path) if os.path.isdir(path) else None
        if names is None:
            found = "nothing (no such directory)"
            if os.path.isdir(f"{path}.old"):  # a save killed between its two renames
                found += f"; {path}.old is the checkpoint before it: rename it to {path}"
        elif ".metadata" in names:
            found = "a DCP checkpoint (--optim adamw8bit)"
        elif any(n.startswith("rank_") for n in names):
            found = "the per-rank files of --optim zero_one_adam"
            if isinstance(optimizer, ZeroOneAdam):
                found += ", none for this rank (saved on fewer ranks)"
        else:
            found = "no checkpoint"
        raise FileNotFoundError(
            f"--resume: {path} holds {found}; {type(optimizer).__name__} loads "
            f"{os.path.basename(want)} (rank {dist.get_rank()}): resume with the --optim (and, "
            "for zero_one_adam, the number of ranks) that saved it"
        )
    if isinstance(optimizer, ZeroOneAdam):
        state = torch.load(per_rank)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optim"])
        return int(state["step"])
    # get_state_dict gives the layout to load into (it also creates the optimizer's state).
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state = {"model": model_sd, "optim": optim_sd, "step": 0}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(
        model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    return int(state["step"])


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line; ``args.zeropp`` is the :class:`ZeroPPConfig` to shard with."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--ranks-per-node", type=int, default=None, help="emulate nodes")
    parser.add_argument("--optim", choices=["adamw8bit", "zero_one_adam"], default="adamw8bit")
    parser.add_argument(
        "--zeropp",
        type=zeropp_config,
        default=None,
        help="off, all, hsdp, or a list: qwz,hpz (default: all; adamw8bit only)",
    )
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per step")
    parser.add_argument("--batch-size", type=int, default=4, help="sequences per micro-batch")
    parser.add_argument("--context", type=int, default=64)
    parser.add_argument("--checkpoint", default=None, help="save here at the end")
    parser.add_argument("--resume", action="store_true", help="start from --checkpoint")
    parser.add_argument(
        "--save-pretrained",
        default=None,
        metavar="DIR",
        help="at the end, write the model for LlamaForCausalLM.from_pretrained(DIR)",
    )
    args = parser.parse_args(argv)
    if args.resume and not args.checkpoint:
        parser.error("--resume loads --checkpoint: pass --checkpoint DIR (the run to continue)")
    if args.optim == "zero_one_adam" and args.zeropp not in (None, ZeroPPConfig()):
        # the model stays replicated: the ZeRO++ features would be dropped without a word
        parser.error(
            "--zeropp shards the model, and --optim zero_one_adam keeps it replicated (the "
            "optimizer communicates): drop --zeropp, or pass --optim adamw8bit"
        )
    if args.zeropp is None:
        args.zeropp = zeropp_config("all" if args.optim == "adamw8bit" else "off")
    return args


def main() -> None:
    args = parse_args()
    use_cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if use_cuda else "gloo")
    rank = dist.get_rank()
    device = (
        torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
    )
    if use_cuda:
        torch.cuda.set_device(device)
    topology = Topology.from_env(ranks_per_node=args.ranks_per_node)

    model = build_model(llama_config(context=args.context), seed=0, device=device)
    optimizer = parallelize(model, optim=args.optim, topology=topology, zeropp=args.zeropp)
    start = load_checkpoint(args.checkpoint, model, optimizer) if args.resume else 0
    if start >= args.steps:
        # saving here would label the checkpoint with the smaller --steps: a later resume would
        # train those steps twice
        raise SystemExit(
            f"{args.checkpoint} is at step {start}, not below --steps {args.steps}: nothing to "
            f"train; pass --steps above {start} to continue"
        )
    tokens = corpus()
    for step in range(start, args.steps):
        batches = micro_batches(
            tokens,
            step=step,
            rank=rank,
            accum=args.accum,
            batch=args.batch_size,
            context=args.context,
        )
        loss, norm = train_step(
            model,
            optimizer,
            batches,
            lr=1e-3 * min(1.0, (step + 1) / 5),
            keep_weights=isinstance(model, FSDPModule) and not args.zeropp.hsdp,
        )
        mean = torch.tensor([loss], device=device)
        dist.all_reduce(mean)
        if rank == 0:
            mean_loss = mean.item() / dist.get_world_size()
            print(f"step {step:3d}  loss {mean_loss:.4f}  grad norm {norm:.3f}", flush=True)
    if args.checkpoint:
        save_checkpoint(args.checkpoint, model, optimizer, step=args.steps)
        if rank == 0:
            print(f"saved step {args.steps} to {args.checkpoint}")
    if args.save_pretrained:
        save_pretrained(args.save_pretrained, model)
        if rank == 0:
            print(f"wrote {args.save_pretrained} (LlamaForCausalLM.from_pretrained loads it)")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
