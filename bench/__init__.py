"""omni benchmarks, each measured side by side with its baselines in one run and reported as
ratios. Run ``python -m bench --help``; results land in ``bench/results/`` as JSON.

Scenarios: ``hop`` (per-hop latency), ``throughput`` (requests/s at a given concurrency),
``stream`` (chunks/s and per-chunk latency through a stage→stage ``stream_to`` edge),
``relay`` (GB/s of each installed relay against memcpy), ``startup`` (time to ready against bare
torch-importing processes), ``scale`` (latency and memory as in-flight requests and payloads
grow). hop, throughput and stream also report CPU µs per message of every process
(``bench/cpu.py``); ``--doc docs/performance`` rewrites the tables of its pages (``bench/report.py``). This package imports neither torch nor omni at import time: baseline worker processes
import it and must start bare.
"""
