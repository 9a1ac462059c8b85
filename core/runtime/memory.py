"""Bytes held, counted by storage: a tied or shared weight counts once."""


def storage(t) -> tuple[int, int]:
    """(identity, bytes) of the memory behind a tensor. oneDNN's packed weights (models/cpu_quant.py)
    have no storage object: each is its own block."""
    if t.is_mkldnn:
        return id(t), t.numel() * t.element_size()
    return t.untyped_storage().data_ptr(), t.untyped_storage().nbytes()


def tensor_bytes(tensors) -> int:
    """Bytes of distinct storages (a tied or shared weight counts once)."""
    blocks = dict(storage(t) for t in tensors)
    return sum(blocks.values())
