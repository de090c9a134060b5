"""Which modules ``shard()`` wraps one by one: :func:`find_blocks` (a Hugging Face model's
declared layers, the children of the outermost ``nn.ModuleList``s, or what ``blocks=`` says),
checked before anything is wrapped."""

from __future__ import annotations

from collections.abc import Sequence

from torch import nn
from torch.distributed.fsdp import FSDPModule

__all__ = ["find_blocks"]


def find_blocks(
    model: nn.Module, blocks: Sequence[nn.Module] | tuple[type, ...] | type | None = None
) -> list[nn.Module]:
    """The modules to wrap one by one, in forward order.

    ``None``: the outermost submodules of the classes a Hugging Face model names in its
    ``_no_split_modules`` (its decoder layers), else the children of every outermost
    ``nn.ModuleList`` (a transformer's layers); a declared module that shares a parameter with
    a module outside it (BERT's embeddings, tied to its head) is left to the root unit, see
    [Note: declared blocks exclude tied ones]; a model with neither is refused (pass
    ``blocks=``). A class or tuple of classes: every outermost submodule of those types; a
    sequence of modules: those, as given (in forward order, each once, never the model itself;
    a block nested in another one listed before it, as FSDP2 wraps inner units first).
    """
    if blocks is None:
        found = _untied(model, _declared_blocks(model)) or _listed_blocks(model)
        if not found:
            raise ValueError(
                f"found no blocks in {type(model).__name__}: without blocks=, shard() wraps the "
                "classes a Hugging Face model names in _no_split_modules, else the children of "
                "each outermost nn.ModuleList, and this model has neither. Pass blocks= (the "
                "block class, e.g. blocks=MyDecoderLayer, or a list of submodules) to say what "
                "FSDP2 shards one by one"
            )
        return found
    if isinstance(blocks, type) or (
        isinstance(blocks, tuple) and blocks and all(isinstance(b, type) for b in blocks)
    ):
        found, taken = [], set()
        for mod in model.modules():
            if id(mod) not in taken and isinstance(mod, blocks) and mod is not model:
                found.append(mod)
                taken.update(id(m) for m in mod.modules())
        if not found:
            raise ValueError(f"no submodule of {type(model).__name__} is an instance of {blocks}")
        return found
    mods = [blocks] if isinstance(blocks, str) else list(blocks)
    owned = {id(m) for m in model.modules()}
    for i, m in enumerate(mods):
        if isinstance(m, str):
            # a class name (accelerate's fsdp_transformer_layer_cls_to_wrap): a bare string was
            # read as a list of one-letter modules, refused with "got str"
            cls = next((type(x) for x in model.modules() if type(x).__name__ == m), None)
            fix = (
                f"pass the class, blocks={m} (from {cls.__module__})"
                if cls is not None
                else f"no submodule of {type(model).__name__} is a {m}"
            )
            raise ValueError(
                f"blocks={blocks!r} names a class by a string: {fix}; without blocks=, "
                "shard() finds the classes a Hugging Face model names in _no_split_modules"
            )
        if isinstance(m, type):
            # a list or set of classes (FSDP1's transformer_layer_cls={...}) read as modules
            # said "got type"; classes go in a tuple
            raise ValueError(
                f"blocks[{i}] is the class {m.__name__}, not a module: a list holds submodules; "
                f"pass classes as blocks={m.__name__} or as a tuple, blocks=({m.__name__}, ...)"
            )
        if not isinstance(m, nn.Module) or id(m) not in owned:
            raise ValueError(f"blocks must be submodules of the model; got {type(m).__name__}")
    # Checked before any fully_shard, which would otherwise fail halfway (the model left
    # partly sharded) with FSDP2's assertion or an internal invariant error. A block inside a
    # later one is fine (FSDP2 nests units wrapped inner first).
    inside: dict[int, int] = {}  # id of a module -> index of the last block holding it
    for i, m in enumerate(mods):
        if m is model:
            raise ValueError(
                "blocks must not contain the model itself: shard() wraps the model last, as "
                "the root (its own parameters: embeddings, final norm, head); list its blocks"
            )
        if id(m) in inside:
            j = inside[id(m)]
            if mods[j] is m:
                raise ValueError(
                    f"blocks[{i}] ({type(m).__name__}) is listed twice (also blocks[{j}]): "
                    "each block is wrapped once"
                )
            raise ValueError(
                f"blocks[{i}] ({type(m).__name__}) lies inside blocks[{j}] "
                f"({type(mods[j]).__name__}), listed before it: FSDP2 wraps a nested unit "
                "before the unit around it, so list the inner one first"
            )
        inside.update((id(sub), i) for sub in m.modules())
    return mods


def _declared_blocks(model: nn.Module) -> list[nn.Module]:
    # Hugging Face's own declaration of its repeated layers (what its FSDP wrapping uses).
    names = getattr(model, "_no_split_modules", None) or ()
    found: list[nn.Module] = []
    taken: set[int] = set()
    for mod in model.modules():
        if id(mod) not in taken and mod is not model and _class_name(mod) in names:
            found.append(mod)
            taken.update(id(m) for m in mod.modules())
    return found


def _class_name(mod: nn.Module) -> str:
    """The name of ``mod``'s class, or, for a module ``fully_shard`` has wrapped, of the class
    it wrapped: FSDP2 swaps the class for ``FSDP<name>`` (bases ``FSDPModule`` and the
    original), so a decoder layer the user had wrapped by hand no longer matched its
    ``_no_split_modules`` name, was not found as a block, and ``shard()`` went on without it
    (left out of prefetching, hpZ and the kept blocks) instead of refusing it as
    already sharded."""
    cls = type(mod)
    if isinstance(mod, FSDPModule):
        cls = next((b for b in cls.__bases__ if b is not FSDPModule), cls)
    return cls.__name__


def _untied(model: nn.Module, found: list[nn.Module]) -> list[nn.Module]:
    """[Note: declared blocks exclude tied ones] The modules of a Hugging Face model's
    ``_no_split_modules`` classes less those sharing a parameter with the root unit (a module
    outside every declared one).
    ``_no_split_modules`` says what ``device_map`` must not split across devices, and it names
    embedding modules too: BERT's names ``BertEmbeddings``, whose word embedding is the
    masked-LM head's weight (RoBERTa's ``RobertaEmbeddings`` alike). FSDP2 keeps a tied parameter
    in one unit, so ``shard(bert)`` refused the blocks it had picked itself, naming a
    ``blocks=`` the user never passed. Left out here, such a module's parameters join the root
    unit with the head that shares them, as a hand-written ``blocks=`` of the encoder layers
    does. Only this tie is resolved so: one between two declared layers, across
    ``nn.ModuleList`` children or across ``blocks=`` is the model's own doing and stays refused
    (moving whole layers into the root unit without a word would change the memory the run
    needs)."""
    holders: dict[int, set[int]] = {}  # id of a parameter -> ids of the modules holding it
    for mod in model.modules():
        for p in mod.parameters(recurse=False):
            holders.setdefault(id(p), set()).add(id(mod))
    declared = {id(m) for block in found for m in block.modules()}
    return [block for block in found if all(holders[id(p)] <= declared for p in block.parameters())]


def _listed_blocks(model: nn.Module) -> list[nn.Module]:
    """The children of every outermost ``nn.ModuleList``, in order. A child that is itself a
    container without a forward (an ``nn.ModuleList`` of stages, each a list of blocks, or an
    ``nn.ModuleDict``) gives its own children: FSDP2 refuses to wrap such a container ("does
    not support containers that do not implement forward"), and ``shard()`` passed that on
    without naming ``blocks=``. A block listed twice (one layer applied twice, ALBERT-style
    sharing) is one unit: the second entry was refused as a parameter "shared by blocks[0] and
    blocks[1]" though the user never passed ``blocks=``."""
    found: list[nn.Module] = []
    taken: set[int] = set()

    def add(children) -> None:
        for child in children:
            if id(child) in taken:
                continue
            taken.add(id(child))
            if isinstance(child, nn.ModuleList):
                add(child)
            elif isinstance(child, nn.ModuleDict):
                add(child.values())
            else:
                found.append(child)
                taken.update(id(m) for m in child.modules())

    for mod in model.modules():
        if id(mod) not in taken and isinstance(mod, nn.ModuleList):
            add(mod)
            taken.update(id(m) for m in mod.modules())
    return found
