"""The top-level names resolve to the objects of the sub-packages that own them."""

import importlib

import qshard


def test_every_public_name_resolves_to_its_owner():
    for name in qshard.__all__:
        obj = getattr(qshard, name)
        if name == "__version__":
            assert isinstance(obj, str)
            continue
        owner = importlib.import_module(qshard._LAZY[name])
        assert obj is getattr(owner, name)
        assert name in owner.__all__


def test_unknown_name_is_an_attribute_error():
    try:
        qshard.NoSuchThing  # noqa: B018
    except AttributeError as e:
        assert "NoSuchThing" in str(e)
    else:
        raise AssertionError("expected AttributeError")
