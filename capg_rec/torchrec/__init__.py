"""TorchRec integration: a two-tower retriever on (sharded) embedding tables, scored against the
whole catalog, whose output the capg_rec losses and samplers accept directly.

Needs TorchRec, which is optional: install it with ::

    pip install "capg-rec[torchrec]"          # fbgemm-gpu-cpu and TorchRec's other dependencies
    pip install --no-deps torchrec==1.8.0     # TorchRec itself (its metadata pulls the CUDA fbgemm-gpu)
"""

try:
    import torchrec  # noqa: F401
except ImportError as err:  # pragma: no cover - depends on the environment
    raise ImportError(
        "capg_rec.torchrec needs TorchRec. Install it with:\n"
        '    pip install "capg-rec[torchrec]"\n'
        "    pip install --no-deps torchrec==1.8.0\n"
        "(fbgemm-gpu-cpu must be the build matching your torch: 1.8.0 for torch 2.13)"
    ) from err

from capg_rec.baselines import ContextBaseline, global_mean_baseline  # torch.distributed only: also at the top level
from capg_rec.torchrec.catalog import ShardedEmbeddingCatalog
from capg_rec.torchrec.index_head import IndexHead
from capg_rec.torchrec.retriever import TwoTowerRetriever

__all__ = ["ContextBaseline", "IndexHead", "ShardedEmbeddingCatalog", "TwoTowerRetriever", "global_mean_baseline"]
