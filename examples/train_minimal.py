"""Drop qshard into your own FSDP2 training loop: ZeRO++ sharding, AdamW8bit, a comm ledger.

This is an ordinary FSDP2 loop with three lines changed (marked ``# qshard``):

1. ``fully_shard(block)`` per block + ``fully_shard(model)``  ->  ``qshard.zeropp.shard(...)``
   with the ZeRO++ features you want (quantized weights, hierarchical partitioning, quantized
   gradients);
2. ``torch.optim.AdamW``  ->  ``qshard.optim.AdamW8bit`` (same arguments, ~2 bytes of state per
   parameter instead of 8);
3. optionally, a :class:`qshard.comm.CommLedger` that counts the bytes every collective sends,
   split into intra-node and inter-node links.

Run it on one machine, 4 CPU ranks emulating 2 nodes of 2::

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 4 examples/train_minimal.py --ranks-per-node 2

On a real cluster drop ``--ranks-per-node`` (torchrun's ``LOCAL_WORLD_SIZE`` says where the
node boundaries are) and run with ``--nnodes N``; NCCL is used when CUDA is present.
The model is qshard's small GPT; any ``nn.Module`` whose repeated blocks sit in an
``nn.ModuleList`` works the same way.
"""

from __future__ import annotations

import argparse
import os
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict

from qshard.comm import CommLedger, Topology, recording
from qshard.optim import AdamW8bit
from qshard.train.model import GPT, GPTConfig
from qshard.zeropp import ZeroPPConfig, shard

parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
parser.add_argument("--ranks-per-node", type=int, default=None, help="emulate nodes of this size")
parser.add_argument("--steps", type=int, default=20)
parser.add_argument("--batch-size", type=int, default=4, help="sequences per rank")
parser.add_argument("--context", type=int, default=64)
parser.add_argument("--checkpoint", default=None, help="save a DCP checkpoint here at the end")
args = parser.parse_args()

# --- the usual distributed set-up -----------------------------------------------------------
use_cuda = torch.cuda.is_available()
dist.init_process_group("nccl" if use_cuda else "gloo")
rank, world = dist.get_rank(), dist.get_world_size()
device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
if use_cuda:
    torch.cuda.set_device(device)
torch.manual_seed(1234 + rank)

# Where the node boundaries are: from LOCAL_WORLD_SIZE under torchrun, or emulated.
topology = Topology.from_env(ranks_per_node=args.ranks_per_node)  # qshard

# --- the model: build it the same on every rank (deterministic init) ------------------------
config = GPTConfig(context=args.context, n_layer=2, n_head=4, n_embd=128, seed=0)
model = GPT(config).to(device)

# Plain FSDP2 would be:
#     for block in model.blocks: fully_shard(block)
#     fully_shard(model)
# ZeRO++ is the same sharding with three collectives replaced:
shard(  # qshard
    model,
    topology=topology,
    config=ZeroPPConfig(qwz=True, hpz=True, qgz=True),
)

# Same arguments as torch.optim.AdamW; the state is 8-bit block-wise quantized.
optimizer = AdamW8bit(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.1)  # qshard

# --- data: any token stream; here the bytes of this file, random windows per rank ------------
with open(__file__, "rb") as f:
    data = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()


def get_batch() -> tuple[torch.Tensor, torch.Tensor]:
    starts = torch.randint(0, data.numel() - args.context - 1, (args.batch_size,))
    window = torch.stack([data[s : s + args.context + 1] for s in starts.tolist()])
    return window[:, :-1].to(device), window[:, 1:].to(device)


# --- the training loop: unchanged FSDP2 code ------------------------------------------------
ledger = CommLedger(topology)  # qshard: counts bytes per collective and link class
with recording(ledger):
    for step in range(args.steps):
        t0 = time.perf_counter()
        x, y = get_batch()
        _, loss = model(x, y)
        loss.backward()
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).full_tensor()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        step_bytes = ledger.step()  # this step's bytes, per node

        loss_avg = loss.detach().clone()
        dist.all_reduce(loss_avg, op=dist.ReduceOp.AVG if use_cuda else dist.ReduceOp.SUM)
        if not use_cuda:  # gloo has no AVG
            loss_avg /= world
        if rank == 0:
            print(
                f"step {step:3d}  loss {loss_avg.item():.4f}  grad norm {grad_norm.item():.3f}  "
                f"inter-node {step_bytes.inter_node_bytes / 1024:.1f} KiB  "
                f"intra-node {step_bytes.intra_node_bytes / 1024:.1f} KiB  "
                f"{time.perf_counter() - t0:.2f} s",
                flush=True,
            )

# --- what it cost, per collective (all ranks take part in the gather) ------------------------
summary = ledger.gather_summary()
if rank == 0:
    print(f"\nper step, per node, over {args.steps} steps ({topology}):")
    for tag, op, calls, _, intra, inter in summary.rows():
        print(
            f"  {tag:<22} {op:<15} {calls / args.steps:5.1f} calls  "
            f"intra {intra / args.steps / 1024:8.1f} KiB  inter {inter / args.steps / 1024:8.1f} KiB"
        )

# --- checkpoint with DCP: model and 8-bit optimizer state, loadable on any number of ranks ---
if args.checkpoint:
    model_sd, optim_sd = get_state_dict(model, optimizer)
    dcp.save({"model": model_sd, "optim": optim_sd}, checkpoint_id=args.checkpoint)
    if rank == 0:
        print(f"saved checkpoint to {args.checkpoint}")

dist.destroy_process_group()
