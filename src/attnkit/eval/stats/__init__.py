"""The statistics every table and the report share: 95 % intervals (:mod:`.intervals`), which differences from
full attention hold (:mod:`.significance`), one row per cell from a stochastic method's seeds (:mod:`.seed_rows`),
and the plain-text score table ``attnkit eval`` prints (:mod:`.table`). Pure functions of result rows."""
