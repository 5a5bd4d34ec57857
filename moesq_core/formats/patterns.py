"""Sparsity pattern sets: which entries of each K-group of a weight row are kept.

A pattern set has P admissible patterns over groups of `group` consecutive input columns. Masks are bool
tensors shaped like the weight ([out, in], True = kept); pattern indices are [out, in/group] int64.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch


def _bits(rows: list[str]) -> torch.Tensor:
    return torch.tensor([[c == "1" for c in r] for r in rows], dtype=torch.bool)


@dataclass(frozen=True)
class PatternSet:
    name: str
    group: int
    rows: tuple[str, ...]
    patterns: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "patterns", _bits(list(self.rows)))

    @property
    def num_patterns(self) -> int:
        return len(self.rows)

    @property
    def kept_per_group(self) -> int:
        return self.rows[0].count("1")

    @property
    def is_dense(self) -> bool:
        return self.kept_per_group == self.group

    def pattern_matrix(self, device=None, dtype=torch.float32) -> torch.Tensor:
        """[P, group] 0/1 matrix."""
        return self.patterns.to(device=device, dtype=dtype)

    def check_shape(self, in_features: int, block: int = 1, what: str = "weight") -> None:
        need = max(self.group, block)
        if in_features % need:
            raise ValueError(
                f"{what}: input dimension {in_features} is not a multiple of {need}, "
                f"which format pattern set {self.name!r} (groups of {self.group}, scale blocks of {block}) needs"
            )

    def mask_from_index(self, idx: torch.Tensor) -> torch.Tensor:
        """[..., G] pattern indices -> [..., G*group] bool mask."""
        m = self.patterns.to(idx.device)[idx]
        return m.reshape(*idx.shape[:-1], idx.shape[-1] * self.group)

    def best_index(self, scores: torch.Tensor) -> torch.Tensor:
        """Pattern maximising the summed score of kept entries per group; ties -> lowest index.

        scores: [..., in] (e.g. |w|, w^2/[H^-1]_jj). Returns [..., in/group].
        """
        g = scores.reshape(*scores.shape[:-1], -1, self.group).float()
        return (g @ self.pattern_matrix(scores.device).T).argmax(-1)

    def best_mask(self, scores: torch.Tensor) -> torch.Tensor:
        return self.mask_from_index(self.best_index(scores))

    def index_from_mask(self, mask: torch.Tensor) -> torch.Tensor:
        """Inverse of mask_from_index; raises if a group matches no admissible pattern."""
        idx, ok = self.match(mask)
        if not bool(ok.all()):
            bad = (~ok).nonzero()[0].tolist()
            raise ValueError(f"mask group at {bad} is not an admissible {self.name} pattern")
        return idx

    def match(self, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(pattern index, valid) per group; index is meaningless where valid is False."""
        g = mask.reshape(*mask.shape[:-1], -1, self.group)
        eq = (g.unsqueeze(-2) == self.patterns.to(mask.device)).all(-1)  # [..., G, P]
        return eq.float().argmax(-1), eq.any(-1)

    def overlap_init(self, mask: torch.Tensor) -> torch.Tensor:
        """Centred overlap c[..., G, P] between each pattern and a given support (the refine init of A).

        For paired 4:8 this is +2 for the matched pattern, 0 for one shared pair, -2 for the complement.
        """
        g = mask.reshape(*mask.shape[:-1], -1, self.group).float()
        P = self.pattern_matrix(mask.device)
        overlap = g @ P.T  # kept entries shared with each pattern
        # Scaled so a full match is +2 whatever the group size (4 kept entries for p48, 2 for s24).
        return (overlap - overlap.mean(-1, keepdim=True)) * (4.0 / self.kept_per_group)


DENSE = PatternSet("dense", 1, ("1",))
# The public release's order so indices interoperate.
P48 = PatternSet("p48", 8, ("11110000", "11001100", "11000011", "00111100", "00110011", "00001111"))
S24 = PatternSet("s24", 4, ("1100", "1010", "1001", "0110", "0101", "0011"))

PATTERN_SETS = {p.name: p for p in (DENSE, P48, S24)}
