"""Offline calibration tools that write JSON configs (``attnkit calibrate ...``).

- :mod:`attnkit.calibrate.patterns`: MInference's kernel-aware search of a sparse pattern per head.
- :mod:`attnkit.calibrate.heads`: Share-Attention's head clusters by the eq. 9 distance (Taniguchi et al.).
- :mod:`attnkit.calibrate.filter_layer`: Select-Attention's filter-layer sweep (Taniguchi et al., section 4.2).
- :mod:`attnkit.calibrate.duo`: DuoAttention's retrieval heads by a gate per kv head (Xiao et al., section 2.2).
- :mod:`attnkit.calibrate.kvzap`: KVzap's surrogate of kvzip's scores per layer (Jégou, Jeblick).
- :mod:`attnkit.calibrate.fastkvzip`: Fast KVzip's gates per layer, distilled from kvzip's scores (Kim et al.).
- :mod:`attnkit.calibrate.lukv`: LU-KV's budget curve per layer and kv head (Tang et al.).
- :mod:`attnkit.calibrate.restorekv`: RestoreKV's restore tokens and LoRA adapters, self-distilled around kvzip.
- :mod:`attnkit.calibrate.triattention`: TriAttention's pre-RoPE query statistics per head (Mao et al.).
- :mod:`attnkit.calibrate.qfilter`: Q-Filters' query direction per layer and kv head (Godey et al.).
- :mod:`attnkit.calibrate.expected_attention`: Expected Attention's pre-RoPE query mean and covariance (Devoto et al.).
"""

import sys


def progress_to_stderr(message: str) -> None:
    """The calibration commands' progress lines (stderr, so stdout keeps only the summary)."""
    print(f"  {message}", file=sys.stderr, flush=True)
