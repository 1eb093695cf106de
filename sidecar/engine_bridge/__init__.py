"""The engine bridge: the one door from the asyncio side to the engine thread.

loop.py (``EngineLoop``: the LLMEngine on its own thread, stepping between the commands it is sent),
client.py (``EngineClient``: the awaitable calls the rest of the sidecar makes), results.py (the
typed, frozen values a turn or a pruning hands back across the thread boundary). It imports nothing
of the sidecar outside itself.
"""
