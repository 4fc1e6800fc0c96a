"""Layer 4, one wrapped model: the `Pager` that orchestrates its blocks
(`pager`), what a use of a block does (`uses`), its hooks (`hooks`),
served accesses to paged-out tensors (`serving`), block discovery
(`discover`), state carried across forwards (`carried`), and models that
share one budget (`pool`)."""
