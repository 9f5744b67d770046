"""omni-contrib-stages: reusable stages, wiring functions and the ``demo`` pipeline for omni.

Installed, it plugs into omni through the ``omni`` entry point (``omni_contrib_stages.plugin``);
nothing needs importing. What it registers (reference: ``docs/stages.md``):

- stages: ``contrib.torch_module`` (any ``torch.nn.Module``, micro-batched), ``contrib.function``
  (a plain Python function), ``contrib.tee``, ``contrib.collect``, and the demo's
  ``contrib.demo.*`` stages;
- functions: ``contrib.concat_tensors`` / ``contrib.stack_tensors`` (merge),
  ``contrib.tensors_only`` / ``contrib.drop_tensors`` / ``contrib.drop_private`` /
  ``contrib.split.<part>`` (project_payload), ``contrib.route.to`` (route); builders for your own
  in :mod:`omni_contrib_stages.functions`;
- the pipeline ``demo``: ``omni run demo --input '{"text": "hello"}' --stream``.
"""

__version__ = "0.1.0"
