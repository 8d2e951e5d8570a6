"""Prices from genai-prices applied without the library's per-call decomposition: every
flat price it ships gives the library's value and digits, tiered prices and odd usage
still go through the library, and a priced step does not call the library again."""

from __future__ import annotations

from decimal import Decimal
from pathlib import Path
from typing import Any

import pytest
from genai_prices import Usage, data
from genai_prices.types import ModelPrice, TieredPrices
from hypothesis import given, settings
from hypothesis import strategies as st

import tether
from tether import ai
from tether.ai._pricing import ModelPricing, lookup_pricing


def _library(price: Any, tokens_in: int, tokens_out: int, cache_read: int) -> Decimal:
    usage = Usage(input_tokens=tokens_in, output_tokens=tokens_out, cache_read_tokens=cache_read)
    total: Decimal = price.calc_price(usage)["total_price"]
    return total


def _all_prices() -> list[tuple[str, Any]]:
    out = []
    for provider in data.providers:
        for model in provider.models:
            prices = model.prices
            listed = [prices] if isinstance(prices, ModelPrice) else [p.prices for p in prices]
            out += [(f"{provider.id}/{model.id}", p) for p in listed]
    return out


ALL = _all_prices()
PRICINGS = [(name, ModelPricing(price)) for name, price in ALL]


def test_most_shipped_prices_are_flat_and_tiered_ones_are_not() -> None:
    flat = [p for _, p in PRICINGS if p.flat]
    tiered = [
        p for _, p in PRICINGS if any(isinstance(v, TieredPrices) for v in vars(p.price).values())
    ]
    assert len(flat) > 0.8 * len(PRICINGS), (len(flat), len(PRICINGS))
    assert tiered and not any(p.flat for p in tiered)


@settings(max_examples=30, deadline=None)
@given(
    tokens_in=st.integers(0, 3_000_000),
    tokens_out=st.integers(0, 200_000),
    cached=st.floats(0, 1),
)
def test_every_shipped_price_costs_what_the_library_says(
    tokens_in: int, tokens_out: int, cached: float
) -> None:
    """Same value and same string (the recorded cost is its string) for every price
    genai-prices ships, flat or tiered, at any usage."""
    cache_read = int(tokens_in * cached)
    for name, pricing in PRICINGS:
        want = _library(pricing.price, tokens_in, tokens_out, cache_read)
        got = pricing.cost(tokens_in, tokens_out, cache_read)
        assert (got, str(got)) == (want, str(want)), name


def test_usage_the_library_would_refuse_still_goes_to_it() -> None:
    """More cache reads than input tokens: not priced by the flat rates (the library
    decides, as before: its error is what the step records)."""
    pricing = lookup_pricing("gpt-4o", "openai")
    assert pricing is not None and pricing.flat
    try:
        want: Any = _library(pricing.price, 10, 5, 20)
    except Exception as exc:
        with pytest.raises(type(exc)):
            pricing.cost(10, 5, 20)
    else:
        assert pricing.cost(10, 5, 20) == want


async def test_a_priced_step_does_not_run_the_library_per_call(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``gpt-4o`` (a flat price): the library is asked while the price is looked up,
    then never again, however many calls are priced."""
    app = tether.App(tmp_path / "t.db")
    gateway = ai.Gateway(app)
    model = gateway.model("m", ai.openai_compatible("gpt-4o", base_url="http://x", api_key="k"))
    calls = 0
    real = ModelPrice.calc_price

    def counted(self: ModelPrice, usage: Any) -> Any:
        nonlocal calls
        calls += 1
        return real(self, usage)

    monkeypatch.setattr(ModelPrice, "calc_price", counted)
    first = gateway.price_of(model, 1000, 100, 0, None, None)
    looked_up = calls
    for i in range(50):
        cost = gateway.price_of(model, 1000 + i, 100, i, None, None)
        assert cost is not None
    assert calls == looked_up
    pricing = lookup_pricing("gpt-4o", "openai")
    assert pricing is not None
    assert first == str(_library(pricing.price, 1000, 100, 0))
    await app.close()


async def test_prices_are_looked_up_again_each_hour(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A long-lived worker takes up a price genai-prices dates (a change announced
    ahead) within the hour: the looked-up prices are kept for the hour they were read."""
    from tether.ai import _gateway

    hour = [1000]
    monkeypatch.setattr(_gateway, "_hour", lambda: hour[0])
    looked: list[tuple[str, str | None]] = []

    def counted(model: str, provider: str | None) -> Any:
        looked.append((model, provider))
        return lookup_pricing(model, provider)

    monkeypatch.setattr(_gateway, "lookup_pricing", counted)
    app = tether.App(tmp_path / "t.db")
    gateway = ai.Gateway(app)
    model = gateway.model("m", ai.openai_compatible("gpt-4o", base_url="http://x", api_key="k"))
    for _ in range(3):
        assert gateway.price_of(model, 1000, 100, 0, None, None) is not None
    assert len(looked) == 1
    hour[0] += 1
    assert gateway.price_of(model, 1000, 100, 0, None, None) is not None
    assert len(looked) == 2
    await app.close()


def test_cache_reads_priced_at_the_input_rate_keep_the_library_digits() -> None:
    """A price naming ``cache_read_mtok`` at the input rate: the library sums input and
    cache reads as two terms, whose digits (a trailing zero) the sum keeps (review find:
    the rates compared equal and one term was used)."""
    price = ModelPrice(
        input_mtok=Decimal("1"), cache_read_mtok=Decimal("1"), output_mtok=Decimal("2")
    )
    pricing = ModelPricing(price)
    assert pricing.flat
    for usage in [(10, 5, 5), (1000, 10, 0), (100, 100, 100), (1_000_000, 0, 1), (7, 0, 3)]:
        want = _library(price, *usage)
        got = pricing.cost(*usage)
        assert (got, str(got)) == (want, str(want)), usage


def test_rates_are_learned_at_full_precision_whatever_the_callers_context() -> None:
    """Learned under a thread's low-precision decimal context, rounded rates would be
    kept for every later call."""
    import decimal

    price = ModelPrice(input_mtok=Decimal("0.435"), output_mtok=Decimal("1.7475"))
    with decimal.localcontext(decimal.Context(prec=4)):
        pricing = ModelPricing(price)
    got = pricing.cost(123456, 789, 0)
    assert got == _library(price, 123456, 789, 0)


@pytest.mark.parametrize(
    "usage", [(0, 0, 0), (1, 1, 0), (1000, 1000, 1000), (10**6, 10**6, 10**5), (10**9, 10, 10**8)]
)
def test_round_counts_keep_the_library_digits(usage: tuple[int, int, int]) -> None:
    for name, pricing in PRICINGS:
        want = _library(pricing.price, *usage)
        got = pricing.cost(*usage)
        assert (got, str(got)) == (want, str(want)), name
