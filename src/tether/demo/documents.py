"""The sample documents ``tether demo`` processes: invoices, contracts, support
tickets, a long report and a memo nobody can classify with confidence."""

from __future__ import annotations

from pydantic import BaseModel


class Document(BaseModel):
    """What a caller submits to the pipeline."""

    doc_id: str
    title: str
    text: str


def _report() -> str:
    """A long quarterly report with headed sections: summarised by map-reduce."""
    regions = ["North", "South", "East", "West", "Central", "Online"]
    sections = ["# Quarterly operations report, Q3\n\nPrepared by the operations office."]
    for i, region in enumerate(regions):
        orders = 1200 + 137 * i
        late = 2 + (i * 3) % 7
        sections.append(
            f"## {region} region\n\n"
            f"The {region} region shipped {orders} orders this quarter. "
            f"Late deliveries were {late} percent of the total, "
            f"{'down' if i % 2 else 'up'} from the previous quarter. "
            "Staffing held steady and no site closed.\n\n"
            f"Customer complaints in {region} centred on packaging and on the tracking "
            "emails arriving after the parcel. The team trialled a new carrier for bulky "
            "items and will report on it next quarter. Returns stayed under four percent.\n\n"
            f"Inventory in {region} turned {4 + i % 3} times. Two suppliers were late with "
            "seasonal stock; both have signed revised delivery terms."
        )
    sections.append(
        "## Outlook\n\nVolumes are expected to grow eight percent next quarter. The main "
        "risks are carrier capacity in December and the price of packaging board."
    )
    return "\n\n".join(sections)


SAMPLES: list[Document] = [
    Document(
        doc_id="inv-0001",
        title="Invoice 4411, Acme Corp",
        text="INVOICE 4411\nFrom: Acme Corp\nTo: Globex Ltd\nCurrency: EUR\n"
        "Line: 12 widgets @ 40.00 = 480.00\nLine: 3 gears @ 70.00 = 210.00\nTotal: 690.00\n"
        "Payment due in 30 days.",
    ),
    Document(
        doc_id="inv-0002",
        title="Invoice 7730, Initech",
        text="INVOICE 7730\nFrom: Initech\nTo: Globex Ltd\nCurrency: USD\n"
        "Line: 1 audit @ 2500.00 = 2500.00\nTotal: 2500.00\nPayment due in 14 days.",
    ),
    Document(
        doc_id="inv-0003",
        title="Invoice 9012, Umbrella",
        text="INVOICE 9012\nFrom: Umbrella plc\nTo: Globex Ltd\nCurrency: GBP\n"
        "Line: 10 licences @ 99.00 = 990.00\nLine: 1 support plan @ 200.00 = 200.00\n"
        "Total: 1190.00\nPayment due in 30 days.",
    ),
    Document(
        doc_id="ctr-0001",
        title="Services agreement, Initech and Umbrella",
        text="SERVICES AGREEMENT between Initech and Umbrella plc, effective 1 March, for "
        "a term of 24 months, renewing automatically unless either party gives 90 days "
        "notice. Governing law: England.",
    ),
    Document(
        doc_id="ctr-0002",
        title="Non-disclosure agreement, Globex and Hooli",
        text="MUTUAL NON-DISCLOSURE AGREEMENT between Globex Ltd and Hooli Inc, effective "
        "on signature, for a term of 36 months. Governing law: Delaware.",
    ),
    Document(
        doc_id="tkt-0001",
        title="Ticket: charged twice",
        text="SUPPORT TICKET from dana@example.com: I was charged twice for my March "
        "subscription. Please refund the second charge.",
    ),
    Document(
        doc_id="tkt-0002",
        title="Ticket: cannot log in",
        text="SUPPORT TICKET from lee@example.com: the login page says my password "
        "expired and the reset email never arrives.",
    ),
    Document(
        doc_id="tkt-0003",
        title="Ticket: vague complaint",
        text="Note from a customer: things have been strange lately, not sure whom to "
        "ask. Maybe billing, maybe the app.",
    ),
    Document(doc_id="rpt-0001", title="Quarterly operations report", text=_report()),
    Document(
        doc_id="memo-0001",
        title="Memo: lunch and ideas",
        text="Team lunch moved to Friday at Luigi's. Bring ideas for the offsite.",
    ),
]
