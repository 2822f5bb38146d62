"""trio actors of the serving engine (DESIGN.md data flow) and the messages they exchange.

messages.py   typed messages on the channels between actors
intake.py     validates and tokenizes new requests, applies sampling defaults and limits
scheduler.py  the step loop: admissions, aborts, stop hits, planning, applying sampled tokens
executor.py   runs a step's model work in a worker thread (one per device)
output.py     detokenizes / matches stop strings a step behind, fans outputs out to request sinks
engine.py     AsyncEngine (the streaming interface for the HTTP layer) and open_engine()
"""

from candle_vllm.actors.engine import AsyncEngine, EngineRejection, EngineStats, open_engine

__all__ = ["AsyncEngine", "EngineRejection", "EngineStats", "open_engine"]
