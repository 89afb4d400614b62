"""Running evaluations: ``attnkit eval``'s harness (:mod:`.harness`), the cells it runs here or on Ray
(:mod:`.cells`, :mod:`.ray_cells`), resumable sweeps (:mod:`.sweep`), the crash-safe results store and its
one-writer lock (:mod:`.results`, :mod:`.lock`), where a row comes from (:mod:`.provenance`), and kvpress's
presses as peers run in their own environment (:mod:`.peers`, :mod:`.kvpress_worker`)."""
