"""Pure-PyTorch stand-in for SGLang's native CPU kernel library (sgl-kernel built with
pyproject_cpu.toml), which PyPI does not ship. Only what a small dense Llama model needs on the
`torch_native` attention path on a CPU without AMX is implemented; other names that SGLang
imports unconditionally on CPU exist but raise NotImplementedError if called; any other name
is missing (ImportError), so SGLang's optional-import fallbacks still take effect."""
__version__ = "0.0.0+torchshim"


def _stub(qualname):
    def f(*args, **kwargs):
        raise NotImplementedError(f"{qualname} is not in the pure-torch sgl_kernel shim")
    f.__name__ = qualname.rsplit(".", 1)[-1]
    f.__qualname__ = qualname
    return f


def assign_req_to_token_pool_cpu(req_pool_indices, req_to_token, start_offset, end_offset,
                                 out_cache_loc, pool_len):
    """req_to_token[req_pool_indices[i], start[i]:end[i]] = the next (end[i]-start[i]) entries
    of out_cache_loc: the contract of SGLang's Triton kernel assign_req_to_token_pool."""
    off = 0
    for row, s, e in zip(req_pool_indices.tolist(), start_offset.tolist(), end_offset.tolist(),
                         strict=True):
        n = e - s
        if n > 0:
            req_to_token[row, s:e] = out_cache_loc[off:off + n].to(req_to_token.dtype)
        off += n


# Imported at module level by SGLang on CPU (KV-move and speculative-decoding paths); not used here.
STUB_NAMES = {
    "copy_all_layer_kv_cache_cpu", "assign_draft_cache_locs_contiguous_cpu",
    "assign_extend_cache_locs_cpu", "build_draft_decode_metadata_cpu",
    "build_tree_kernel_efficient_cpu", "fill_accept_out_cache_loc_cpu", "fill_bonus_tokens_cpu",
    "rotate_input_ids_cpu", "verify_tree_greedy_cpu",
}


def __getattr__(name):
    if name in STUB_NAMES:
        return _stub(f"sgl_kernel.{name}")
    raise AttributeError(f"module 'sgl_kernel' (pure-torch shim) has no attribute {name!r}")
