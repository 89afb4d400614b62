"""``attnkit tune``: the recipes it searches (:mod:`.space`), what it decides from the evidence of each round
(:mod:`.rules`), and the search itself, which runs rounds of cells and writes the recipe and its report
(:mod:`.search`)."""
