"""Layer 0, codecs: how a page's bytes are encoded (`compress`) and decoded
on the device (`kernels`, Triton, with the CPU reference). Pure functions of
bytes; imports nothing else of pager."""
