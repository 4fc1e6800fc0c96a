"""Layer 3, observation: counters (`stats`), the printed report
(`report`) and the Perfetto trace (`trace`)."""
