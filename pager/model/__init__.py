"""Layer 4, one wrapped model: the `Pager` that orchestrates its blocks
(`pager`), what a use of a block does (`uses`), its hooks (`hooks`), the
step boundary (`steps`), prefetch (`prefetch`), guards for direct calls
(`direct_calls`), the structure check (`structure`), served accesses to
paged-out tensors (`serving`), building the blocks (`build`), block
discovery (`discover`), state carried across forwards (`carried`), and
models that share one budget (`pool`)."""
