"""Layer 3, training: the optimizer link (`optim`), gradients as stand-ins
and their operations (`grads`, `grad_ops`), activations under the budget
(`activations`), state dicts (`checkpoint`), data parallel (`distributed`)."""
