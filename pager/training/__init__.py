"""Layer 3, training: the optimizer link (`optim`), gradients as stand-ins,
in their pages and their operations (`grads`, `grad_pages`, `grad_ops`),
activations under the budget (`activations`), state dicts (`checkpoint`),
data parallel (`distributed`)."""
