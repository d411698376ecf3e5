"""Meshes that keep their text, so that Dynamo captures bodies annotating shardings.

torch_xla 2.9's ``MarkShardingFunction`` passes ``str(mesh)`` to its op, and Dynamo cannot fold
that string to a constant (``keep_mesh_texts``); ``xla.eager`` installs this and asks
``mesh_texts_made`` whether a failed capture is worth another try.
"""
from .. import _compat

_mesh_texts = {"installed": False, "made": 0}


def keep_mesh_texts():
    """Let Dynamo capture bodies that call ``mark_sharding_with_gradients``.

    torch_xla 2.9's ``MarkShardingFunction`` passes ``str(mesh)`` to its op,
    and ``Mesh.__str__`` formats ``device_ids.tolist()``, a numpy array that
    Dynamo traces as a tensor: the string is no constant and the capture fails,
    so every eager scan on XLA with such a body re-traced it on the make_fx
    route. A mesh is not changed after it is made, so its text is kept on it the
    first time it is made (at construction, or the first ``str``) and read back
    as a plain attribute, which Dynamo reads as a constant (guarded by value).
    Installed once, only when torch_xla's SPMD module is loaded."""
    module = _compat.xla.spmd_module()
    if _mesh_texts["installed"] or module is None:
        return
    mesh_type, formatted, init = module.Mesh, module.Mesh.__str__, module.Mesh.__init__

    def text_of(mesh):
        text = mesh.__dict__.get("_torch_scan_hop_text")
        if text is None:
            text = mesh.__dict__["_torch_scan_hop_text"] = formatted(mesh)
            _mesh_texts["made"] += 1
        return text

    def __str__(self):
        text = getattr(self, "_torch_scan_hop_text", None)  # what Dynamo reads: an attribute
        return text_of(self) if text is None else text

    def __init__(self, *args, **kwargs):
        init(self, *args, **kwargs)
        text_of(self)

    mesh_type.__str__, mesh_type.__init__ = __str__, __init__
    _mesh_texts["installed"] = True


def mesh_texts_made():
    """How many meshes' texts ``keep_mesh_texts`` has made so far: a body whose
    capture failed on a mesh made before it was installed is worth one more try."""
    return _mesh_texts["made"]
