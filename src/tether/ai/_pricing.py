"""A model's genai-prices price, made cheap to apply on every model step.

genai-prices works out a cost by decomposing the usage into every unit it knows
(about 80 microseconds a call), and a step prices twice (its estimate and its answer).
Most prices are flat rates per token, so their cost is linear in the three counts a
step has: the rates are read once from the library itself and applied with the same
decimal arithmetic, giving the same value and the same digits. Tiered prices, and any
usage the library might refuse, still go through the library.
"""

from __future__ import annotations

from decimal import Context, Decimal, localcontext
from typing import Any

#: tokens per rate: the library's prices are per million tokens
_MTOK = 1_000_000
#: a usage to check the rates against the library once, off any round number
_CHECK = (1_234_567, 76_543, 234_567)


class ModelPricing:
    """The cost of a step's tokens at one genai-prices ``ModelPrice``."""

    __slots__ = ("_apart", "_base", "_cached", "_input", "_output", "price")

    def __init__(self, price: Any) -> None:
        self.price = price
        self._base: Decimal | None = None
        self._input = self._output = self._cached = Decimal(0)
        self._apart = False
        if all(
            isinstance(value, Decimal)
            for key, value in vars(price).items()
            if not key.startswith("_") and value is not None
        ):
            try:
                self._learn_rates()
            except Exception:  # the library refused a probe: it prices every call itself
                self._base = None

    def _learn_rates(self) -> None:
        """Read the flat rates (per million tokens) and the per-request part from the
        library, and keep them only if they reproduce its answer for an odd usage."""
        # at the default precision, whatever the caller's: rates rounded by a thread's
        # low-precision context would be kept for every later call
        with localcontext(Context()):
            base = self._library(0, 0, 0)
            self._input = self._library(_MTOK, 0, 0) - base
            self._output = self._library(0, _MTOK, 0) - base
            self._cached = self._library(_MTOK, 0, _MTOK) - base
            #: the library prices cache reads as a unit of their own when the price
            #: names them, even at the input rate: the sum's digits follow its terms
            self._apart = getattr(self.price, "cache_read_mtok", None) is not None
            self._base = base
            want = self._library(*_CHECK)
            got = self.cost(*_CHECK)
        if (got, str(got)) != (want, str(want)):
            self._base = None

    def _library(self, tokens_in: int, tokens_out: int, cache_read: int) -> Decimal:
        from genai_prices import Usage

        usage = Usage(
            input_tokens=tokens_in, output_tokens=tokens_out, cache_read_tokens=cache_read
        )
        total: Decimal = self.price.calc_price(usage)["total_price"]
        return total

    @property
    def flat(self) -> bool:
        """Whether this price is applied without the library (flat rates, checked)."""
        return self._base is not None

    def cost(self, tokens_in: int, tokens_out: int, cache_read: int) -> Decimal:
        """The cost in USD of ``tokens_in`` input tokens (``cache_read`` of them read
        from the provider's cache) and ``tokens_out`` output tokens."""
        base = self._base
        if base is None or not 0 <= cache_read <= tokens_in or tokens_out < 0:
            return self._library(tokens_in, tokens_out, cache_read)
        # one term per unit, each divided on its own, as the library sums them: the
        # digits of the result (trailing zeros included) come out the same
        if not self._apart:  # cache reads are input tokens like any other
            return base + self._input * tokens_in / _MTOK + self._output * tokens_out / _MTOK
        return (
            base
            + self._input * (tokens_in - cache_read) / _MTOK
            + self._cached * cache_read / _MTOK
            + self._output * tokens_out / _MTOK
        )


def lookup_pricing(model: str, provider: str | None) -> ModelPricing | None:
    """genai-prices' current price of ``model`` at ``provider`` (None when it has none)."""
    try:
        from genai_prices import Usage, calc_price

        return ModelPricing(calc_price(Usage(), model_ref=model, provider_id=provider).model_price)
    except Exception:
        return None
