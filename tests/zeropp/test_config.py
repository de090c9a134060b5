"""ZeroPPConfig validation, block discovery, the wire codec and the op factors (no world), and
shard()'s refusals before it wraps anything (a one-rank world in this process)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn
from torch.distributed import ReduceOp

from qshard.nn import StableEmbedding
from qshard.quant.blockwise import dequantize_blockwise, quantize_blockwise
from qshard.train.model import GPT, Block, GPTConfig
from qshard.zeropp import ZeroPPConfig, find_blocks
from qshard.zeropp._wire import RowCodec
from qshard.zeropp.reduce_scatter import op_scale, reorder_slices


def test_defaults_are_plain_fsdp2():
    cfg = ZeroPPConfig()
    assert not cfg.any_feature and cfg.wire_dtype is None


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight_bits": 6}, "weight_bits must be 8 or 4"),
        ({"grad_bits": 2}, "grad_bits must be 4 or 8"),
        ({"weight_block_size": 100}, "multiple of 8"),
        ({"grad_block_size": 0}, "multiple of 8"),
        ({"pipeline_stages": 0}, "pipeline_stages"),
        ({"prefetch_depth": 0}, "prefetch_depth"),
        ({"wire_dtype": torch.float64}, "wire_dtype"),
        # floats and bools equal to a valid int pass a membership test, then break the wire
        # rows' byte arithmetic in the first collective (a TypeError from torch.empty)
        ({"weight_bits": 8.0}, "weight_bits must be 8 or 4"),
        ({"grad_bits": 4.0}, "grad_bits must be 4 or 8"),
        ({"hsdp": True, "replicate_bits": 8.0}, "replicate_bits must be None, 8 or 4"),
        ({"grad_block_size": 256.0}, "multiple of 8"),
        ({"pipeline_stages": True}, "pipeline_stages"),
        ({"prefetch_depth": True}, "prefetch_depth"),
    ],
)
def test_validation(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"weight_bits": 4}, "weight_bits=4 configures qwz, which is off; set qwz=True"),
        ({"weight_block_size": 64}, "configures qwz"),
        ({"grad_bits": 8}, "grad_bits=8 configures qgz"),
        ({"grad_block_size": 64, "qwz": True}, "configures qgz"),
        ({"pipeline_stages": 2, "hpz": True}, "pipeline_stages=2 configures qgz"),
    ],
)
def test_a_knob_of_a_feature_that_is_off_is_refused(kwargs, match):
    # it used to be ignored without a word: weight_bits=4 without qwz gathered fp32
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs)
    feature = "qwz" if "weight" in match or "qwz" in match else "qgz"
    ZeroPPConfig(**{**kwargs, feature: True})  # with the feature on: fine


@pytest.mark.parametrize(
    ("kwargs", "match", "fixed"),
    [
        # each was accepted and changed nothing (the ledger's bytes, the prefetch order)
        ({"replicate_block_size": 64}, "configures HSDP", {"hsdp": True, "replicate_bits": 8}),
        (
            {"hsdp": True, "replicate_block_size": 64},
            "replicate_block_size=64 configures the quantized replicate reduction",
            {"replicate_bits": 4},
        ),
        (
            {"hsdp": True, "wire_dtype": torch.bfloat16, "replicate_block_size": 64},
            "set replicate_bits=8 or 4",
            {"replicate_bits": 8},
        ),
        (
            {"hsdp": True, "replicate_reduce": False, "replicate_block_size": 64},
            "nothing to compress",
            {"replicate_block_size": 256},
        ),
        ({"prefetch": False, "prefetch_depth": 3}, "configures prefetch", {"prefetch": True}),
        (
            {"hsdp": True, "overlap_reduce_scatter": True},
            "FSDP2's own full-precision replicate all-reduce .* which needs its output at once",
            {"overlap_reduce_scatter": False},
        ),
        (
            {"hsdp": True, "overlap_reduce_scatter": True, "replicate_reduce": False},
            "replicate_reduce=False, which sends nothing across nodes to overlap: drop "
            "overlap_reduce_scatter, or set replicate_reduce=True and compress",
            {"replicate_reduce": True, "replicate_bits": 4},
        ),
    ],
)
def test_a_knob_that_would_be_ignored_is_refused(kwargs, match, fixed):
    with pytest.raises(ValueError, match=match):
        ZeroPPConfig(**kwargs)
    ZeroPPConfig(**{**kwargs, **fixed})  # the fix the message names is accepted


def test_comms_refuse_float_bits_and_block_sizes():
    from qshard.comm import Topology
    from qshard.zeropp import HierarchicalQuantizedReduceScatter, QuantizedAllGather

    topo = Topology(world_size=1, ranks_per_node=1)
    for cls in (QuantizedAllGather, HierarchicalQuantizedReduceScatter):
        with pytest.raises(ValueError, match="bits must be"):
            cls(topology=topo, bits=8.0)
        with pytest.raises(ValueError, match="block_size must be"):
            cls(topology=topo, block_size=256.0)


def test_qwz_hop2_is_issued_at_the_call_on_cuda_only():
    from qshard.comm import Topology
    from qshard.zeropp import QuantizedAllGather

    ag = QuantizedAllGather(topology=Topology(world_size=4, ranks_per_node=2))
    assert ag._hop2_at_call(torch.device("cuda", 0))
    assert not ag._hop2_at_call(torch.device("cpu"))
    assert not ag._hop2_at_call(torch.device("meta"))


def test_unknown_and_positional_options_are_errors():
    with pytest.raises(TypeError):
        ZeroPPConfig(qwZ=True)  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ZeroPPConfig(True)  # type: ignore[misc]
    with pytest.raises(TypeError, match="qwz must be a bool"):
        ZeroPPConfig(qwz=1)  # type: ignore[arg-type]
    for bad in (-1, 1.0, True, "2"):
        with pytest.raises(ValueError, match="keep_last_blocks must be None"):
            ZeroPPConfig(keep_last_blocks=bad)  # type: ignore[arg-type]
    # the default holds no more unsharded blocks than the prefetching step's peak
    assert ZeroPPConfig().kept_blocks == 2
    assert ZeroPPConfig(prefetch_depth=2).kept_blocks == 3
    assert ZeroPPConfig(prefetch=False).kept_blocks == 2
    assert ZeroPPConfig(keep_last_blocks=0).kept_blocks == 0
    with pytest.raises(TypeError, match="overlap_reduce_scatter must be None or a bool"):
        ZeroPPConfig(qgz=True, overlap_reduce_scatter="yes")  # type: ignore[arg-type]
    # the default: on with any ZeRO++ feature, off for plain ZeRO-3 (shard() decides)
    assert ZeroPPConfig().overlap_reduce_scatter is None


def test_find_blocks():
    model = GPT(GPTConfig(n_layer=3, n_embd=32, n_head=2, context=8))
    assert find_blocks(model) == list(model.blocks)
    assert find_blocks(model, Block) == list(model.blocks)
    assert find_blocks(model, [model.blocks[1]]) == [model.blocks[1]]
    with pytest.raises(ValueError, match="submodules"):
        find_blocks(model, [nn.Linear(2, 2)])
    with pytest.raises(ValueError, match="instance of"):
        find_blocks(model, nn.Conv2d)
    # refused before shard() calls fully_shard, which would fail halfway through the model
    # (FSDP2's "applied to a module once" assertion, or an invariant error for an outer block
    # listed before a block inside it); inner-first nesting is what FSDP2 supports
    with pytest.raises(ValueError, match="model itself"):
        find_blocks(model, [model])
    with pytest.raises(ValueError, match="listed twice"):
        find_blocks(model, [model.blocks[0], model.blocks[0]])
    inner = next(model.blocks[0].children())
    with pytest.raises(ValueError, match="list the inner one first"):
        find_blocks(model, [model.blocks[0], inner])
    assert find_blocks(model, [inner, model.blocks[0]]) == [inner, model.blocks[0]]
    # nested lists: only the outermost list's children
    outer = nn.Sequential(nn.ModuleList([nn.Sequential(nn.ModuleList([nn.Linear(2, 2)]))]))
    assert find_blocks(outer) == [outer[0][0]]
    # ...but a child that is itself a container without forward (stages of blocks) gives its
    # children: FSDP2 refuses to wrap a ModuleList, and find_blocks returned two of them
    a, b, c, d = (nn.Linear(2, 2) for _ in range(4))
    staged = nn.Sequential(nn.ModuleList([nn.ModuleList([a, b]), nn.ModuleDict({"x": c}), d]))
    assert find_blocks(staged) == [a, b, c, d]
    # one layer listed twice (ALBERT-style sharing) is one block: the second entry was refused
    # as a parameter "shared by blocks[0] and blocks[1]" of a blocks= nobody passed
    shared = nn.Sequential(nn.ModuleList([a, a, b]))
    assert find_blocks(shared) == [a, b]


def test_quantized_all_gather_refuses_a_missing_topology():
    """``QuantizedAllGather(topology=None)`` was accepted and failed inside the first forward
    ("'NoneType' object has no attribute 'is_intra_node'")."""
    from qshard.zeropp import QuantizedAllGather

    with pytest.raises(TypeError, match=r"topology must be a qshard.comm.Topology.*from_env"):
        QuantizedAllGather(topology=None)  # type: ignore[arg-type]


def test_op_scale():
    assert op_scale(ReduceOp.AVG, 8) == 1 / 8
    assert op_scale(ReduceOp.SUM, 8) == 1
    import torch.distributed as dist

    assert op_scale(dist._make_nccl_premul_sum(0.25), 8) == 0.25
    with pytest.raises(ValueError, match="AVG, SUM and PREMUL_SUM"):
        op_scale(ReduceOp.MAX, 8)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.integers(1, 5),
    blocks=st.integers(1, 4),
    block=st.sampled_from([8, 16, 64]),
    bits=st.sampled_from([4, 8, None]),
    seed=st.integers(0, 2**16),
)
def test_row_codec_matches_blockwise_per_row(rows, blocks, block, bits, seed):
    """Each wire row decodes to exactly what the quant core gives for that row alone (chunk
    invariance), and its byte count is codes + 4 bytes per block."""
    g = torch.Generator().manual_seed(seed)
    m = blocks * block
    x = torch.randn(rows, m, generator=g) * 10
    codec = RowCodec(bits=bits, block_size=block)
    buf = codec.encode(x)
    assert buf.dtype == torch.uint8 and buf.shape == (rows, codec.row_bytes(m))
    y = codec.decode(buf, m)
    if bits is None:
        assert torch.equal(y, x)
        return
    assert codec.row_bytes(m) == 4 * blocks + m * bits // 8
    for r in range(rows):
        q = quantize_blockwise(x[r], bits=bits, block_size=block)
        assert torch.equal(y[r], dequantize_blockwise(q))


@settings(max_examples=60, deadline=None)
@given(
    nodes=st.integers(1, 5),
    per_node=st.integers(1, 4),
    stages=st.integers(1, 3),
    size=st.integers(1, 9),
)
def test_qgz_slice_order_is_paper_eq2_and_two_hops_route_every_partition(
    nodes, per_node, stages, size
):
    """Simulate both all-to-all hops on the reordered buffers of every rank: each rank must end
    with exactly the sum of its own partition; with one stage the order is eq. 2."""
    world = nodes * per_node
    padded = -(-size // stages) * stages
    # rank r's buffer: partition p holds values 1000 * r + 10 * p + position (unique per rank)
    bufs = [
        torch.tensor(
            [[1000.0 * r + 10 * p + i for i in range(size)] for p in range(world)],
            dtype=torch.float64,
        )
        for r in range(world)
    ]
    laid = [reorder_slices(b, nodes, per_node, stages, padded) for b in bufs]
    if stages == 1:
        flat = laid[0].reshape(world, padded)
        for p in range(world):
            slot = (p % per_node) * nodes + p // per_node
            assert torch.equal(flat[slot, :size], bufs[0][p])
    for n in range(nodes):
        for d in range(per_node):
            rank = n * per_node + d
            got = []
            for k in range(stages):
                # hop 1: from every local peer i of node m, chunk d (its partitions (*, d))
                partial = {
                    m: sum(laid[m * per_node + i][k, d] for i in range(per_node))
                    for m in range(nodes)
                }
                # hop 2: from every node m, the slice for node n
                got.append(sum(partial[m][n] for m in range(nodes)))
            want = sum(b[rank] for b in bufs)
            assert torch.equal(torch.cat(got)[:size], want)
            assert not torch.cat(got)[size:].any()


def test_find_blocks_leaves_a_declared_module_tied_to_the_head_to_the_root():
    # BERT's _no_split_modules names BertEmbeddings, whose word embedding is the masked-LM
    # head's weight: found as a block, shard() then refused the tie across units it had made
    # itself. A declared module tied to the root is left to the root unit; the layers stay.
    class Embeddings(nn.Module):
        def __init__(self):
            super().__init__()
            self.word = nn.Embedding(16, 8)
            self.norm = nn.LayerNorm(8)

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = nn.Linear(8, 8)

    class Model(nn.Module):
        _no_split_modules = ("Embeddings", "Layer")

        def __init__(self):
            super().__init__()
            self.embeddings = Embeddings()
            self.layers = nn.ModuleList([Layer(), Layer()])
            self.head = nn.Linear(8, 16, bias=False)

    model = Model()
    assert find_blocks(model) == [model.embeddings, *model.layers]  # untied: all declared
    model.head.weight = model.embeddings.word.weight
    assert find_blocks(model) == list(model.layers)
    # a tie between two declared layers is the model's own: both stay blocks (shard() refuses
    # it, naming blocks=), as do blocks the user lists
    model.layers[1].fc.weight = model.layers[0].fc.weight
    assert find_blocks(model) == list(model.layers)
    assert find_blocks(model, [model.embeddings]) == [model.embeddings]


def test_find_blocks_refuses_class_names_naming_the_class():
    # accelerate's fsdp_transformer_layer_cls_to_wrap is a class name: blocks="Block" was read
    # as the modules "B", "l", ... and refused with "got str"
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, context=8))
    for blocks in ("Block", ["Block"], ("Block",)):
        with pytest.raises(ValueError, match=r"by a string: pass the class, blocks=Block \(from "):
            find_blocks(model, blocks)
    with pytest.raises(ValueError, match="no submodule of GPT is a LlamaDecoderLayer"):
        find_blocks(model, "LlamaDecoderLayer")


def test_find_blocks_refuses_a_list_of_classes():
    # a list or set of classes (FSDP1's transformer_layer_cls={...}) was read as modules and
    # refused with "got type"; the message now names the tuple form
    model = GPT(GPTConfig(n_layer=2, n_embd=32, n_head=2, context=8))
    for blocks in ([Block], {Block}, [model.blocks[0], Block]):
        with pytest.raises(ValueError, match=r"is the class Block.*blocks=\(Block, \.\.\.\)"):
            find_blocks(model, blocks)


def test_shard_refuses_what_fsdp2_would_refuse_later(tmp_path):
    """shard()'s arguments and units are checked before anything is wrapped (a one-rank world
    in this process): wrong argument types used to fail with an AttributeError deep inside
    (a dict mp_policy only at the first forward); an already-sharded unit with FSDP2's
    assertion after the blocks before it were wrapped; a parameter tied across two units only
    at the first forward, with advice (fully_shard([a, b])) shard() cannot follow."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from qshard.comm import Topology
    from qshard.zeropp import shard

    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        topo = Topology(world_size=1, ranks_per_node=1)
        cfg = GPTConfig(n_layer=3, n_embd=16, n_head=2, context=8, vocab_size=16)

        def wrapped(model):
            return [n for n, m in model.named_modules() if isinstance(m, FSDPModule)]

        for kwargs, match in (
            (
                {"config": {"qwz": True}},
                r"config must be a ZeroPPConfig.*ZeroPPConfig\(\*\*config\)",
            ),
            ({"topology": None}, r"topology must be a qshard.comm.Topology.*from_env"),
            (
                {"mp_policy": {"param_dtype": torch.bfloat16}},
                r"MixedPrecisionPolicy\(\*\*mp_policy\)",
            ),
            ({"mesh": "cpu"}, r"mesh must be a DeviceMesh"),
        ):
            model = GPT(cfg)
            with pytest.raises(TypeError, match=match):
                shard(model, **{"topology": topo, **kwargs})
            assert wrapped(model) == []

        # the last block wrapped by hand: refused before blocks 0 and 1 are wrapped
        model = GPT(cfg)
        fully_shard(model.blocks[2])
        with pytest.raises(ValueError, match=r"blocks\[2\] \(blocks.2\) is already sharded"):
            shard(model, topology=topo)
        assert wrapped(model) == ["blocks.2"]
        # shard() twice
        model = shard(GPT(cfg), topology=topo)
        with pytest.raises(ValueError, match="already sharded"):
            shard(model, topology=topo, config=ZeroPPConfig(qwz=True))

        # a block's weight reused by the root, or by another block
        model = GPT(cfg)
        model.extra = nn.Linear(16, 16)
        model.blocks[0].attn.proj.weight = model.extra.weight
        with pytest.raises(
            ValueError, match=r"shared by blocks\[0\].*and the root.*out of blocks="
        ):
            shard(model, topology=topo)
        assert wrapped(model) == []
        model = GPT(cfg)
        model.blocks[2].attn.proj.weight = model.blocks[0].attn.proj.weight
        with pytest.raises(ValueError, match=r"shared by blocks\[0\] \(blocks.0\) and blocks\[2\]"):
            shard(model, topology=topo)
        # ...which shard() accepts when the tie lives in one unit: the GPT's own head/embedding
        # tie (both in the root), a tie inside one block, a user's unit inside a block
        # trainable parameters of two dtypes in one unit: FSDP2 accepts the unit and fails at
        # the first forward ("FSDP expects uniform original parameter dtype", no name)
        model = GPT(cfg)
        model.blocks[1].mlp.to(torch.bfloat16)
        with pytest.raises(
            ValueError,
            match=r"blocks\[1\] \(blocks.1\) holds trainable parameters of several "
            r"dtypes.*blocks.1.*model.to\(torch.bfloat16\)",
        ):
            shard(model, topology=topo)
        assert wrapped(model) == []
        model.blocks[1].mlp.requires_grad_(False)  # frozen, FSDP2 takes it
        assert "blocks.1" in wrapped(shard(model, topology=topo))
        # StableEmbedding(dtype=bf16) made its LayerNorm in fp32: a unit of two dtypes
        emb = nn.Sequential(StableEmbedding(16, 8, dtype=torch.bfloat16), nn.Linear(8, 4))
        emb[1].to(torch.bfloat16)
        shard(emb, topology=topo, blocks=[emb[0]])
        assert emb(torch.tensor([[1, 2]])).dtype == torch.bfloat16
        # max_norm renormalises the gathered copy in place, never the shards: warned
        renorm = nn.Sequential(StableEmbedding(16, 8, max_norm=0.5), nn.Linear(8, 4))
        with pytest.warns(UserWarning, match=r"'0' is an embedding with max_norm.*renorm_"):
            shard(renorm, topology=topo, blocks=[renorm[1]])

        model = GPT(cfg)
        model.blocks[1].attn.proj.bias = model.blocks[1].mlp.proj.bias
        fully_shard(model.blocks[1].ln_attn)
        model = shard(model, topology=topo)
        x = torch.randint(0, 16, (2, 8))
        model(x, x)[1].backward()
        assert "blocks.1.ln_attn" in wrapped(model) and "blocks.1" in wrapped(model)
    finally:
        dist.destroy_process_group()


def test_hpz_reshard_spells_the_secondary_shard_as_fsdp2_reads_it():
    """hpZ's ``reshard_after_forward``: the node size, except where FSDP2 reads an int as a
    bool. One rank per node is a whole-parameter secondary shard: ``1`` made FSDP2 log
    "reshard_after_forward=1 (int) means resharding parameters to world size 1" on every
    job and then treat it as ``False``; one node is the world, FSDP2's ``True``."""
    from qshard.comm import Topology
    from qshard.zeropp.shard import _hpz_reshard

    assert _hpz_reshard(Topology(world_size=4, ranks_per_node=1)) is False
    assert _hpz_reshard(Topology(world_size=1, ranks_per_node=1)) is False
    assert _hpz_reshard(Topology(world_size=4, ranks_per_node=4)) is True
    assert _hpz_reshard(Topology(world_size=8, ranks_per_node=2)) == 2
