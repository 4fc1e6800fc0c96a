"""Layer 3, embedding tables paged by rows: one `RowTable` per table
(`table`), its device cache (`cache`), the tensors that stand for it
(`tensors`), reads and writes of host rows (`reader`, `writer`) and the
kernels of the row path (`kernels`)."""
