"""Layer 5, the user's verbs: `wrap`, `unwrap`, `of` (`wrap`), `load` and
`save` (`load`), `plan` (`plan`, with `fake` for activations measured
without running)."""
