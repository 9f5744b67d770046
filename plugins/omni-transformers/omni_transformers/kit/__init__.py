"""The model-agnostic kit of omni-transformers: what a model family builds its stages on.

- :mod:`.family`: the :class:`Family` descriptor, ``family_for(checkpoint)``;
- :mod:`.engines`: per-process sharing of engines (:class:`EngineRegistry`);
- :mod:`.thinker`: the thinker skeleton (decode loop, per-row KV, hooks);
- :mod:`.talker`: the codec-LM talker skeleton (one step → a frame of codes; hooks);
- :mod:`.vocoder`: the streaming vocoder skeleton (chunked synthesis: ready / plan / finish; hooks);
- :mod:`.chunks`: the typed chunks stages stream to each other;
- :mod:`.batched`, :mod:`.sampling`, :mod:`.streams`: row KV caches, sampling, stream reading;
- :mod:`.media`, :mod:`.encoders`: audio/image decoding, the micro-batched encoder skeleton;
- :mod:`.wiring`, :mod:`.checks`: pipeline wiring functions, stage argument checks.

It imports no family. Submodules are imported on use (torch is not imported here).
"""
