"""The model's structure as pager manages it: a parameter, buffer or module
added, replaced or removed after `wrap` is refused at the next forward,
never silently left unpaged. `Structure`, one per wrapped model."""

from __future__ import annotations

from operator import is_not


class Structure:
    """Checks, at each step's first forward, that the model is still the one wrapped.

    Args:
        pager: the model's `Pager` (its model and blocks).
    """

    def __init__(self, pager):
        self.pager = pager
        self._known = {id(t) for b in pager.all_blocks() for w in b.weight_segments for t in w.tensors}

    def snapshot(self) -> None:
        """Remember the model's parameters, buffers and modules as they are at wrap."""
        self._tables = [t for m in self.pager.model.modules() for t in (m._parameters, m._buffers, m._modules)]
        self._table_lens = list(map(len, self._tables))
        entries = [
            (table, name, t)
            for m in self.pager.model.modules()
            for table in (m._parameters, m._buffers)
            for name, t in table.items()
            if t is not None
        ]
        # Columns, so the per-forward identity check runs in C (map/operator).
        self._entry_tables, self._entry_names, self._entry_tensors = (
            (list(c) for c in zip(*entries)) if entries else ([], [], [])
        )
        # Gradients are paged by hooks installed at wrap for trainable parameters.
        self._frozen = [(n, p) for n, p in self.pager.model.named_parameters() if not p.requires_grad]

    def check(self) -> None:
        """Refuse to run on parameters or buffers pager does not manage
        (identity and count checks over a table made at wrap: no module walk)."""
        for name, p in self._frozen:
            if p.requires_grad:
                raise RuntimeError(
                    f"pager: {name!r} was frozen at wrap and now requires grad; its gradients would not be "
                    f"paged. Unfreeze before wrapping: pager.unwrap(model), set requires_grad, then "
                    f"pager.wrap(model, ...) again (freezing after wrap is fine)."
                )
        changed = any(map(is_not, map(dict.get, self._entry_tables, self._entry_names), self._entry_tensors)) or (
            list(map(len, self._tables)) != self._table_lens
        )
        if not changed:
            return
        for name, t in list(self.pager.model.named_parameters(remove_duplicate=False)) + list(
            self.pager.model.named_buffers(remove_duplicate=False)
        ):
            if id(t) not in self._known:
                raise RuntimeError(
                    f"pager: {name!r} was added or replaced after wrap, so pager does not page it (and the old "
                    f"tensor is what it holds). Change models before wrapping: pager.unwrap(model), make the "
                    f"change, then pager.wrap(model, ...) again."
                )
        raise RuntimeError(
            "pager: a module was added to or removed from the model after wrap; pager.unwrap(model), make "
            "the change, then pager.wrap(model, ...) again."
        )
