"""Layer 5, the user's verbs: `wrap`, `unwrap`, `of` (`wrap`), `load` and
`save` (`load`), `from_pretrained` (`pretrained`: a Hugging Face folder),
`plan` (`plan`, with `fake` for activations measured
without running)."""
