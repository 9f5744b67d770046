"""omni-ray: run an omni pipeline across the nodes of a Ray cluster.

Install it beside omni-core (on the driver and on every node) and name it in a pipeline config::

    pip install omni-ray

    launcher:
      name: ray
      options: {address: auto, namespace: omni}
    stages:
      - name: thinker
        factory: ...
        launch: {resources: {node_a: 1}, num_cpus: 1}

- launcher ``ray`` (:mod:`omni_ray.launcher`): every process of the plan runs in a Ray actor (its
  own OS process) that calls the stage host. Actors are owned by the driver (never detached), so
  they die with it; ``stop()`` and a failed start kill them all and wait until Ray reports them
  dead. TP ranks go in one placement group (``STRICT_PACK`` by default). Processes on one node
  talk over ipc; across nodes over tcp, authenticated and encrypted with CurveZMQ under per-run
  keys that reach the actors as constructor arguments.
- placement ``ray`` (:mod:`omni_ray.placement`): assigns processes to nodes and GPUs from the
  cluster's inventory (or a ``cluster.yaml`` for ``omni plan --cluster``).

See docs/multinode.md.
"""

__version__ = "0.1.0"
