"""``attnkit report DIR``: one HTML page from ``results.jsonl`` alone (:mod:`.page`, its HTML pieces in
:mod:`.parts`): the numbers against full attention (:mod:`.summary`), the score tables (:mod:`.score_table`),
the plots (:mod:`.plots` and the ``plot_*`` modules, their shared look in :mod:`.plot_style` and
:mod:`.label_layout`), and the section of ``attnkit tune`` (:mod:`.tune_section`)."""
