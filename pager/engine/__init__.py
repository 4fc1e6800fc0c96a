"""Layer 2, the residency engine: one per budget. What is where and how bytes
move: the engine (`engine`: segments, pins, page states, owners), the room
for blocks and the eviction order (`room`), uses waiting for room
(`waiting`), host tiers and pinned arenas (`tiers`, `host`), the disk tier
(`disk`), copy streams (`transport`), timings (`meter`) and the recorded
order of block use (`schedule`)."""
