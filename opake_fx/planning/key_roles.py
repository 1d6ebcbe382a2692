"""The ledger of the roles a plan's keys play: one key, one role."""

from __future__ import annotations

from opake_fx.errors import InputValueError
from opake_fx.random import RngKey

__all__ = ["KeyRoles"]


class KeyRoles:
    """The ledger of which role each of a plan's keys plays (sampler, noise, adaptive count,
    augmentation): one key, one role.

    Every plan holds one, created with it (:attr:`DPPlan.key_roles`); the samplers and
    pipelines built from the plan record their keys in it, so that the plan itself is never
    changed after construction. It is outside the plan's equality, hash and ``to_dict``
    (a plan is the same plan whichever keys it was used with).

    Privacy: the noise, the sampling, the count noise and the augmentation must draw from
    independent keys; one key in two roles makes, e.g., the noise a function of the same
    random bits as the choice of the batch. :meth:`claim` refuses it.

    Example:
        >>> from opake_fx.random import key
        >>> roles = KeyRoles()
        >>> roles.claim(("sampler", key(1)), ("noise", key(2)))
        >>> roles.role_of(key(2))
        'noise'
        >>> roles.claim(("noise", key(1)))
        Traceback (most recent call last):
          ...
        opake_fx.errors.InputValueError: DPPlan: RngKey(...) is already this plan's sampler key; ...
        >>> roles.claim(("count", key(3)), ("augmentation", key(3)))  # within one call too
        Traceback (most recent call last):
          ...
        opake_fx.errors.InputValueError: DPPlan: RngKey(...) is already this plan's count key; ...
        >>> roles.role_of(key(3)) is None  # a refused call records nothing
        True
    """

    def __init__(self) -> None:
        self._roles: dict[RngKey, str] = {}

    def claim(self, *roles: tuple[str, RngKey]) -> None:
        """Records each ``(role, key)``; refuses a key that already has another role. All are
        checked before any is recorded, so a refused call changes nothing."""
        claimed = dict(self._roles)
        for role, k in roles:
            other = claimed.setdefault(k, role)
            if other != role:
                raise InputValueError(
                    f"DPPlan: {k!r} is already this plan's {other} key; the {role} key must be another one. One key "
                    "in two roles ties the two random draws together (e.g. the noise to the choice of the batch). "
                    "Derive independent keys, e.g. sampler_key, noise_key, count_key = split(key(seed), 3) (for "
                    "several runs from one plan, one split per run: keys distinct across runs too)."
                )
        self._roles = claimed

    def role_of(self, k: RngKey) -> str | None:
        """The role ``k`` was claimed for, or None."""
        return self._roles.get(k)
