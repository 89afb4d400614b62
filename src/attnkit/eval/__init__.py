"""``attnkit eval``, sweeps, the report and ``attnkit tune``, in five layers (each imports only those before it):

- :mod:`attnkit.eval.data`: what a cell is evaluated on: the generated tasks, the data formats users bring
  (LongBench, RULER, InfiniteBench), the retrieval data the bundled model trained on, and the protocols;
- :mod:`attnkit.eval.stats`: intervals, significance against full attention, seeds, the plain-text table;
- :mod:`attnkit.eval.run`: running cells (here and on Ray), sweeps, the results store and its lock, provenance,
  and kvpress as a peer;
- :mod:`attnkit.eval.report`: ``attnkit report``, its page, tables and plots;
- :mod:`attnkit.eval.tune`: ``attnkit tune``: its search space, its rules and its search.
"""
