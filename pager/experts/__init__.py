"""Layer 3, a mixture-of-experts layer's experts paged one by one: which
modules are experts (`find`), the device slots shared by experts of one
layout (`cache`) and one experts module's host tensors and forward (`table`).
See [Note: experts paged one by one] in experts/table.py."""
