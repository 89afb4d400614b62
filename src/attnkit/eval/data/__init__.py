"""What an evaluation cell runs on, with no notion of how cells are run: the seeded tasks in the style of RULER
and LongBench and their registry (:mod:`.tasks`, :mod:`.task_registry`), a sample and its scored items
(:mod:`.sample`, :mod:`.items`), the data formats users bring (:mod:`.longbench`, :mod:`.ruler_data`,
:mod:`.infinitebench`, read by :mod:`.user_data`, with :mod:`.prompting` and :mod:`.metrics`), the compositional
retrieval data the bundled model trained on (:mod:`.retrieval_data`, :mod:`.retrieval_templates`, from the text
of :mod:`.corpus`), and how a method meets the question (:mod:`.protocols`)."""
