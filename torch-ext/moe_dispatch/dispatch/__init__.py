"""Dispatch: tokens into expert order and back, computed on the device without host syncs.

  segments.py    the dispatch metadata (per-expert counts and offsets, sorted token order, the tile map the grouped
                 GEMMs walk: `dispatch`, `segment_dispatch`, `DispatchInfo`) and the v1 `permute_tokens`
  combine.py     each token's top_k expert rows summed back into one row in fixed order (`combine`, the v1
                 `unpermute_tokens`)
  row_copies.py  the row-copy kernels and raw launchers between token order and expert order that segments.py and
                 binned.py share
  binned.py      MegaBlocks-style routing copies (binned, padded and plain gather/scatter, their weight gradients,
                 sort, histogram, cumsum, capacity): public API, checks and autograd

Reference: `reference.permute_tokens_ref`, `unpermute_tokens_ref`, `binned_routing_ref` and the `*_gather_ref` /
`*_scatter_ref` family.
"""
