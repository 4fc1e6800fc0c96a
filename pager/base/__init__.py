"""Layer 1, the records every layer shares: blocks, segments and their page
layout (`block`), budgets and errors (`budget`, `common`), the guards on
paged-out tensors and their registry (`guards`, `registry`), pager's
saved-tensor hooks (`saving`), checkpoint file layouts (`files`)."""
