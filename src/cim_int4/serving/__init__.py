"""Serving cim-int4 models on Ray Serve (the ``serve`` extra): ``cim-int4 serve`` and ``cim-int4 bench-serve``.

* ``app``: the deployments (``/v1/infer`` for an ONNX model, with dynamic batching;
  ``/v1/generate`` for an onnxruntime-genai folder; ``/healthz``) and ``build_app``;
* ``tensors``: request bodies to checked feeds and back, batching by rows (NumPy only);
* ``cpus``: the CPUs each replica claims and pins, disjoint between replicas of a machine;
* ``commands``: the two commands' arguments and runs (Ctrl-C), and the extra's check;
* ``cluster``: a local Ray instance started or a cluster joined, Serve's HTTP proxy, shutdown;
* ``load``: the load benchmark (clients on 127.0.0.1, percentiles, the plot).

Importing this package imports no Ray: ``app`` and ``load`` do. See docs/serving.md.
"""
