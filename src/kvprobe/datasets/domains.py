"""The paper's eight gated domains and the negative-control fields, as data.

Each domain has surface templates (system line, question, rule phrasing), decision fields whose
values split into allowing and denying ones, filler rules irrelevant to the decision, context
lines and neutral record lines. Values are single common words where possible, so that old and
new values tend to tokenize to the same length under BPE tokenizers.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """One phrasing of a domain; ``rule`` has ``{field}`` and ``{allowed}`` placeholders."""

    id: str
    system: str
    question: str
    rule: str


@dataclass(frozen=True)
class DecisionField:
    """A field the domain's rule gates on: the answer is yes iff the value is in ``allow``."""

    name: str
    allow: tuple[str, ...]
    deny: tuple[str, ...]


@dataclass(frozen=True)
class DomainSpec:
    name: str
    templates: tuple[Template, ...]
    fields: tuple[DecisionField, ...]
    fillers: tuple[str, ...]
    context: tuple[str, ...]
    record: tuple[tuple[str, tuple[str, ...]], ...]  # neutral record lines: key -> value pool


# Low-conditioning fields: editing them must not move the decision. Same-shape value pools.
CONTROL_FIELDS: dict[str, tuple[str, ...]] = {
    "timestamp": (
        "2024-05-01T10:00", "2024-06-12T14:30", "2024-07-23T09:15", "2024-08-04T16:45",
        "2024-09-18T11:20", "2024-10-09T08:05", "2024-11-27T13:50", "2024-12-02T17:35",
    ),
    "nonce": ("n4821", "n7305", "n1968", "n5542", "n3079", "n8610", "n2457", "n9134"),
    "request_id": (
        "req-31842", "req-57219", "req-80463", "req-12975",
        "req-64308", "req-29561", "req-73140", "req-45826",
    ),
}  # fmt: skip

OPTIONS = ("yes", "no")


def _t(domain: str, k: int, system: str, question: str, rule: str) -> Template:
    return Template(f"{domain}.t{k}", system, question, rule)


_SPECS = (
    DomainSpec(
        name="retail_refund",
        templates=(
            _t("retail_refund", 0, "You are a support assistant for an online store.",
               "Should the refund be approved?", "Approve a refund only if {field} is {allowed}."),
            _t("retail_refund", 1, "You review refund requests for a retail shop.",
               "Is the customer eligible for a refund?", "A refund may be granted only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("order_status", ("delivered", "returned"), ("pending", "shipped")),
            DecisionField("subscription_tier", ("gold", "premium"), ("free", "basic")),
        ),
        fillers=(
            "Refunds are issued to the original payment method.",
            "Gift cards cannot be exchanged for cash.",
            "Store credit expires after one year.",
            "Shipping fees are shown on the receipt.",
            "Support agents greet the customer by name.",
            "Replies should be short and polite.",
            "Exchanges are handled by the returns team.",
            "Receipts are sent by email after each purchase.",
            "Price matching is handled by a separate team.",
            "Holiday orders ship in branded boxes.",
            "Loyalty points are added once a week.",
            "Customers may track parcels on the website.",
        ),
        context=(
            "The customer wrote in through the chat widget.",
            "The customer says the item did not meet expectations.",
            "The ticket was opened this morning.",
            "The customer asked for a quick answer.",
        ),
        record=(("item", ("headphones", "blender", "jacket")), ("channel", ("web", "phone", "store"))),
    ),
    DomainSpec(
        name="airline_cancel",
        templates=(
            _t("airline_cancel", 0, "You are a booking assistant for an airline.",
               "Should the cancellation be refunded?", "Refund a cancelled booking only if {field} is {allowed}."),
            _t("airline_cancel", 1, "You process cancellation requests for an airline.",
               "Does the passenger get a free cancellation?", "Free cancellation applies only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("fare_type", ("flexible", "business"), ("basic", "economy")),
            DecisionField("region", ("EU", "UK"), ("US", "Asia")),
        ),
        fillers=(
            "Seat upgrades depend on availability.",
            "Meals are served on flights longer than three hours.",
            "Cabin bags must fit under the seat.",
            "Boarding closes twenty minutes before departure.",
            "Passengers may choose seats at check-in.",
            "Lounge access is sold separately.",
            "Pets travel in the cabin only in approved carriers.",
            "Online check-in opens one day before departure.",
            "Name changes are handled by the service desk.",
            "Flight times are shown in local time.",
            "Travel insurance is offered at booking.",
            "Children under two may fly on a lap.",
        ),
        context=(
            "The passenger called the service line.",
            "The passenger mentioned a family event.",
            "The flight departs next week.",
            "The booking was made on the website.",
        ),
        record=(("route", ("Paris", "Berlin", "Madrid")), ("seat", ("window", "aisle", "middle"))),
    ),
    DomainSpec(
        name="deploy_guard",
        templates=(
            _t("deploy_guard", 0, "You are a release assistant for a software team.",
               "Should the deploy proceed?", "Allow a deploy only if {field} is {allowed}."),
            _t("deploy_guard", 1, "You guard production deploys for an engineering team.",
               "Is this deploy allowed to go out?", "A deploy may go out only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("safety_mode", ("relaxed", "off"), ("strict", "locked")),
            DecisionField("account_role", ("admin", "owner"), ("viewer", "guest")),
            DecisionField("ci_status", ("passing", "green"), ("failing", "red")),
        ),
        fillers=(
            "Release notes are written in the changelog.",
            "Each service has its own dashboard.",
            "Logs are kept for thirty days.",
            "Build caches are cleared every Sunday.",
            "Feature flags are named in lower case.",
            "The staging cluster is rebuilt nightly.",
            "Code owners review changes to shared files.",
            "Metrics are sampled every ten seconds.",
            "On Fridays the team holds a demo.",
            "Docs live next to the code.",
            "Old branches are deleted after a merge.",
            "Container images are tagged with the commit.",
        ),
        context=(
            "The change updates a payment service.",
            "The request came from the release channel.",
            "The change was reviewed yesterday.",
            "The team wants to ship before the weekend.",
        ),
        record=(("service", ("billing", "search", "checkout")), ("branch", ("main", "release", "hotfix"))),
    ),
    DomainSpec(
        name="bank_withdraw",
        templates=(
            _t("bank_withdraw", 0, "You are an assistant for a retail bank.",
               "Should the withdrawal be approved?", "Approve a withdrawal only if {field} is {allowed}."),
            _t("bank_withdraw", 1, "You approve cash withdrawals for a bank.",
               "Can the customer withdraw the money?", "Cash may be withdrawn only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("account_role", ("owner", "holder"), ("viewer", "guest")),
            DecisionField("session_counter", ("1", "2"), ("7", "9")),
            DecisionField("account_status", ("active", "verified"), ("frozen", "locked")),
        ),
        fillers=(
            "Statements are sent at the end of each month.",
            "Branch hours are posted on the website.",
            "Interest is paid every quarter.",
            "Cards can be ordered in the app.",
            "Staff must not share internal notes.",
            "Savings goals can be set in the app.",
            "Fees are listed in the price sheet.",
            "Cheques take three days to clear.",
            "Customers may update their address online.",
            "Mortgage advice is given by appointment.",
            "Currency exchange is offered at larger branches.",
            "The app supports dark mode.",
        ),
        context=(
            "The customer is at a cash machine.",
            "The customer is travelling abroad.",
            "The request came through the mobile app.",
            "The customer asked for cash today.",
        ),
        record=(("amount", ("200", "500", "800")), ("channel", ("app", "branch", "phone"))),
    ),
    DomainSpec(
        name="doc_access",
        templates=(
            _t("doc_access", 0, "You control access to internal documents.",
               "Should access be granted?", "Grant access only if {field} is {allowed}."),
            _t("doc_access", 1, "You are a document access assistant for a company.",
               "May the user open the document?", "A document may be opened only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("account_role", ("editor", "admin"), ("viewer", "guest")),
            DecisionField("persona", ("employee", "staff"), ("contractor", "visitor")),
        ),
        fillers=(
            "Documents are stored in shared folders.",
            "File names use lower case letters.",
            "Drafts are marked with a watermark.",
            "Old versions are kept for a year.",
            "Comments are visible to all editors.",
            "Templates live in the team folder.",
            "Printing is logged by the office.",
            "Large files upload in the background.",
            "Folders can be starred for quick access.",
            "Search results show recent files first.",
            "Shared links expire after a week.",
            "The office wiki is updated on Mondays.",
        ),
        context=(
            "The user asked for the quarterly plan.",
            "The request came from a shared laptop.",
            "The document is a budget sheet.",
            "The user needs the file for a meeting.",
        ),
        record=(("document", ("budget", "roadmap", "handbook")), ("device", ("laptop", "tablet", "phone"))),
    ),
    DomainSpec(
        name="rx_safety",
        templates=(
            _t("rx_safety", 0, "You are a pharmacy safety assistant.",
               "Can the prescription be dispensed?", "Dispense a prescription only if {field} is {allowed}."),
            _t("rx_safety", 1, "You check prescriptions before they are dispensed.",
               "Should the pharmacist dispense the medicine?", "Medicine may be dispensed only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("interaction_check", ("clear", "passed"), ("warning", "failed")),
            DecisionField("kidney_function", ("normal", "stable"), ("impaired", "poor")),
            DecisionField("safety_mode", ("standard", "relaxed"), ("strict", "locked")),
        ),
        fillers=(
            "Labels are printed in large type.",
            "Stock is counted every evening.",
            "The pharmacy closes at nine.",
            "Delivery is offered for repeat orders.",
            "Staff wear name badges.",
            "Receipts list the pharmacist on duty.",
            "Generic brands are stocked when possible.",
            "Cold items are kept in the fridge.",
            "Customers may ask for a private room.",
            "Repeat orders can be placed online.",
            "Price lists are updated each month.",
            "Empty bottles can be recycled at the counter.",
        ),
        context=(
            "The patient is waiting at the counter.",
            "The prescription was sent by the clinic.",
            "The patient asked about side effects.",
            "The doctor marked the order as routine.",
        ),
        record=(("medicine", ("ibuprofen", "amoxicillin", "metformin")), ("branch", ("north", "central", "east"))),
    ),
    DomainSpec(
        name="customs_route",
        templates=(
            _t("customs_route", 0, "You route shipments at a customs office.",
               "Can the shipment use the fast lane?", "Send a shipment to the fast lane only if {field} is {allowed}."),
            _t("customs_route", 1, "You are a customs routing assistant.",
               "Should the parcel skip manual inspection?", "A parcel may skip inspection only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("region", ("EU", "UK"), ("US", "Asia")),
            DecisionField("declaration_status", ("filed", "approved"), ("missing", "rejected")),
            DecisionField("locale", ("en", "fr"), ("de", "es")),
        ),
        fillers=(
            "Pallets are weighed at the gate.",
            "Forms may be filed on paper or online.",
            "Trucks queue in lane four.",
            "Seals are checked on arrival.",
            "The office keeps photos of each crate.",
            "Fuel is sold at the north gate.",
            "Drivers must wear safety vests.",
            "Inspection reports are kept for five years.",
            "The gate opens at six.",
            "Tariff tables are updated each quarter.",
            "Couriers may book a loading slot.",
            "Scanners are calibrated every week.",
        ),
        context=(
            "The parcel holds spare parts.",
            "The truck arrived this morning.",
            "The sender is a small business.",
            "The driver asked for a quick answer.",
        ),
        record=(("carrier", ("truck", "rail", "air")), ("goods", ("textiles", "machinery", "books"))),
    ),
    DomainSpec(
        name="oncall_route",
        templates=(
            _t("oncall_route", 0, "You route alerts for an on-call team.",
               "Should the alert page the on-call engineer?", "Page the on-call engineer only if {field} is {allowed}."),
            _t("oncall_route", 1, "You are an alerting assistant for a platform team.",
               "Does this alert wake up the on-call engineer?", "An alert may page someone only when {field} is {allowed}."),
        ),
        fields=(
            DecisionField("severity", ("critical", "high"), ("low", "minor")),
            DecisionField("environment", ("production", "live"), ("staging", "test")),
        ),
        fillers=(
            "Alerts are grouped by service.",
            "Dashboards refresh every minute.",
            "Runbooks are linked from each alert.",
            "The rota changes every Monday.",
            "Quiet hours start at ten.",
            "Chat messages are kept for a month.",
            "Each team owns its alert rules.",
            "Status pages are updated by the lead.",
            "Alert names use snake case.",
            "Incidents get a short summary.",
            "Metrics are stored for a year.",
            "Handover notes are written in the wiki.",
        ),
        context=(
            "The alert fired twice in an hour.",
            "The service had a release today.",
            "The engineer on call is in another time zone.",
            "The alert came from the metrics system.",
        ),
        record=(("service", ("billing", "search", "checkout")), ("team", ("platform", "payments", "storage"))),
    ),
)

DOMAINS: dict[str, DomainSpec] = {spec.name: spec for spec in _SPECS}
