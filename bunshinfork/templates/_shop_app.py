"""A small web shop (catalogue, search, cart, orders) on PostgreSQL; runs INSIDE a workspace.

Started by the web-shop template with the host's /usr/bin/python3 (stdlib + Debian's
python3-psycopg2):

    python3 shop_app.py --port 8080 --dsn "host=/run/postgresql dbname=shop user=postgres"

One logged-in customer (like WebArena's shopping site): the cart and the orders are theirs.
HTTP/1.1 with keep-alive, so a browser holds its connections to the server open; a fork
carries them, and each clone's browser goes on using its own copy.
"""

from __future__ import annotations

import argparse
import html
import json
import threading
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS products (
    id serial PRIMARY KEY, sku text UNIQUE NOT NULL, name text NOT NULL, category text NOT NULL,
    price_cents integer NOT NULL CHECK (price_cents >= 0), stock integer NOT NULL CHECK (stock >= 0),
    description text NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS cart_items (
    product_id integer PRIMARY KEY REFERENCES products, qty integer NOT NULL CHECK (qty > 0));
CREATE TABLE IF NOT EXISTS orders (
    id serial PRIMARY KEY, created_at timestamptz NOT NULL DEFAULT now(), status text NOT NULL DEFAULT 'placed',
    ship_name text NOT NULL, ship_address text NOT NULL, total_cents integer NOT NULL);
CREATE TABLE IF NOT EXISTS order_items (
    order_id integer REFERENCES orders, product_id integer REFERENCES products, qty integer NOT NULL,
    price_cents integer NOT NULL, PRIMARY KEY (order_id, product_id));
"""

PRODUCTS = [
    ("MUG-BLU", "Blue Ceramic Mug", "Kitchen", 1299, 40, "A 350 ml stoneware mug in cobalt blue."),
    ("MUG-RED", "Red Ceramic Mug", "Kitchen", 1299, 25, "A 350 ml stoneware mug in brick red."),
    ("KTL-STL", "Steel Kettle", "Kitchen", 3499, 10, "1.7 l stainless steel stove-top kettle."),
    ("TEA-GRN", "Green Tea (100 g)", "Tea", 899, 60, "Loose-leaf sencha from Shizuoka."),
    ("TEA-BLK", "Black Tea (100 g)", "Tea", 799, 55, "Assam breakfast blend, strong and malty."),
    ("TEA-CHM", "Chamomile Tea (50 g)", "Tea", 699, 30, "Whole chamomile flowers for the evening."),
    ("NTB-A5", "A5 Dotted Notebook", "Office", 1499, 80, "120 g/m2 paper, 192 numbered pages."),
    ("PEN-FNT", "Fountain Pen", "Office", 2499, 15, "Steel nib, medium, with a converter."),
    ("INK-BLU", "Blue Ink Bottle", "Office", 999, 20, "50 ml of permanent blue-black ink."),
    ("LMP-DSK", "Desk Lamp", "Office", 4599, 8, "LED lamp with a dimmer and a warm tone."),
    ("GLV-GRD", "Garden Gloves", "Garden", 1199, 35, "Nitrile-coated gloves, size M."),
    ("SEED-BSL", "Basil Seeds", "Garden", 349, 100, "Genovese basil, about 200 seeds."),
    ("POT-TRC", "Terracotta Pot", "Garden", 1599, 18, "20 cm unglazed pot with a saucer."),
    ("CAN-WTR", "Watering Can", "Garden", 2199, 12, "5 l galvanised steel watering can."),
    ("BAG-TOT", "Canvas Tote Bag", "Accessories", 1099, 45, "Heavy cotton canvas, natural colour."),
    ("UMB-BLK", "Black Umbrella", "Accessories", 2799, 14, "Wind-resistant, automatic opening."),
]

STYLE = """
body { font-family: 'DejaVu Sans', sans-serif; margin: 0; color: #222; background: #fafafa; }
header { background: #234; color: #fff; padding: 10px 20px; display: flex; gap: 20px; align-items: center; }
header a { color: #fff; text-decoration: none; font-weight: bold; }
main { padding: 16px 20px; }
.grid { display: grid; grid-template-columns: repeat(auto-fill, minmax(210px, 1fr)); gap: 12px; }
.card { background: #fff; border: 1px solid #ddd; border-radius: 6px; padding: 10px; }
.price { color: #a30; font-weight: bold; }
table { border-collapse: collapse; background: #fff; }
td, th { border: 1px solid #ddd; padding: 6px 10px; text-align: left; }
.msg { background: #e7f4e4; border: 1px solid #9c9; padding: 8px; margin-bottom: 12px; }
"""


def money(cents: int) -> str:
    return f"${cents / 100:.2f}"


def esc(x: Any) -> str:
    return html.escape(str(x), quote=True)


class Shop:
    """All SQL of the shop. One connection guarded by a lock: a single customer, and a
    long-lived connection that a fork must carry along with the server."""

    def __init__(self, dsn: str) -> None:
        # Imported here so the host can import PRODUCTS from this module without psycopg2.
        import psycopg2  # type: ignore[import-not-found]

        self.conn = psycopg2.connect(dsn)
        self.lock = threading.Lock()

    def q(self, sql: str, args: tuple = (), fetch: bool = True) -> list[tuple]:
        with self.lock:
            try:
                with self.conn.cursor() as cur:
                    cur.execute(sql, args)
                    rows = cur.fetchall() if fetch and cur.description else []
                self.conn.commit()
                return rows
            except Exception:
                self.conn.rollback()
                raise

    def transaction(self, fn: Any) -> Any:
        with self.lock:
            try:
                with self.conn.cursor() as cur:
                    out = fn(cur)
                self.conn.commit()
                return out
            except Exception:
                self.conn.rollback()
                raise

    def setup(self) -> None:
        self.q(SCHEMA, fetch=False)
        for p in PRODUCTS:
            self.q("INSERT INTO products (sku, name, category, price_cents, stock, description) "
                   "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (sku) DO NOTHING", p, fetch=False)

    def cart_count(self) -> int:
        return int(self.q("SELECT coalesce(sum(qty), 0) FROM cart_items")[0][0])

    def checkout(self, name: str, address: str) -> int:
        def tx(cur: Any) -> int:
            cur.execute("SELECT c.product_id, c.qty, p.price_cents, p.stock, p.name FROM cart_items c "
                        "JOIN products p ON p.id = c.product_id ORDER BY c.product_id FOR UPDATE OF p")
            items = cur.fetchall()
            if not items:
                raise ValueError("your cart is empty")
            for _, qty, _, stock, pname in items:
                if qty > stock:
                    raise ValueError(f"only {stock} of {pname} in stock")
            total = sum(qty * price for _, qty, price, _, _ in items)
            cur.execute("INSERT INTO orders (ship_name, ship_address, total_cents) VALUES (%s, %s, %s) "
                        "RETURNING id", (name, address, total))
            oid = cur.fetchone()[0]
            for pid, qty, price, _, _ in items:
                cur.execute("INSERT INTO order_items VALUES (%s, %s, %s, %s)", (oid, pid, qty, price))
                cur.execute("UPDATE products SET stock = stock - %s WHERE id = %s", (qty, pid))
            cur.execute("DELETE FROM cart_items")
            return int(oid)

        return int(self.transaction(tx))


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"  # keep-alive: the browser's connections stay open
    shop: Shop
    server_version = "BunshinShop/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        pass

    # ---- plumbing ----

    def send(self, body: str, status: int = 200, ctype: str = "text/html; charset=utf-8",
             headers: dict[str, str] | None = None) -> None:
        data = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("Cache-Control", "no-store")
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(data)

    def redirect(self, where: str) -> None:
        self.send("", 303, headers={"Location": where})

    def page(self, title: str, body: str, msg: str = "") -> None:
        count = self.shop.cart_count()
        note = f'<div class="msg" role="status">{esc(msg)}</div>' if msg else ""
        self.send(f"""<!doctype html><html lang="en"><head><meta charset="utf-8">
<title>{esc(title)} - Bunshin Shop</title><style>{STYLE}</style></head><body>
<header><a href="/" id="home">Bunshin Shop</a>
<form action="/search" method="get" role="search"><label for="search">Search</label>
<input id="search" name="q" type="search"> <button id="search-button" type="submit">Go</button></form>
<a href="/cart" id="cart-link">Cart ({count})</a><a href="/orders" id="orders-link">My orders</a></header>
<main><h1>{esc(title)}</h1>{note}{body}</main></body></html>""")

    def form(self) -> dict[str, str]:
        n = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(n).decode() if n else ""
        return {k: v[-1] for k, v in urllib.parse.parse_qs(raw, keep_blank_values=True).items()}

    def query(self) -> dict[str, str]:
        q = urllib.parse.urlsplit(self.path).query
        return {k: v[-1] for k, v in urllib.parse.parse_qs(q, keep_blank_values=True).items()}

    # ---- pages ----

    def cards(self, rows: list[tuple]) -> str:
        if not rows:
            return "<p>No products found.</p>"
        out = []
        for pid, name, cat, price, stock in rows:
            out.append(f"""<div class="card"><h2><a href="/product/{pid}">{esc(name)}</a></h2>
<p>{esc(cat)} &middot; <span class="price">{money(price)}</span> &middot; {stock} in stock</p>
<form action="/cart/add" method="post"><input type="hidden" name="product_id" value="{pid}">
<input type="hidden" name="qty" value="1"><button type="submit" aria-label="Add {esc(name)} to cart">
Add to cart</button></form></div>""")
        return '<div class="grid">' + "".join(out) + "</div>"

    def do_GET(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        try:
            if path == "/":
                rows = self.shop.q("SELECT id, name, category, price_cents, stock FROM products ORDER BY id")
                cats = [r[0] for r in self.shop.q("SELECT DISTINCT category FROM products ORDER BY 1")]
                nav = " ".join(f'<a href="/category/{urllib.parse.quote(c)}">{esc(c)}</a>' for c in cats)
                self.page("Catalogue", f"<nav aria-label='Categories'>{nav}</nav>" + self.cards(rows),
                          self.query().get("msg", ""))
            elif path == "/search":
                q = self.query().get("q", "").strip()
                rows = self.shop.q("SELECT id, name, category, price_cents, stock FROM products WHERE name ILIKE %s "
                                   "OR description ILIKE %s OR category ILIKE %s ORDER BY id",
                                   (f"%{q}%",) * 3)
                self.page(f"Search results for \u201c{q}\u201d", self.cards(rows))
            elif path.startswith("/category/"):
                cat = urllib.parse.unquote(path.removeprefix("/category/"))
                rows = self.shop.q("SELECT id, name, category, price_cents, stock FROM products WHERE category = %s "
                                   "ORDER BY id", (cat,))
                self.page(cat, self.cards(rows))
            elif path.startswith("/product/"):
                self.product(int(path.removeprefix("/product/")))
            elif path == "/cart":
                self.cart(self.query().get("msg", ""))
            elif path == "/orders":
                self.orders()
            elif path.startswith("/orders/"):
                self.order(int(path.removeprefix("/orders/")))
            elif path == "/api/state":
                self.send(json.dumps(self.state()), ctype="application/json")
            elif path == "/health":
                self.shop.q("SELECT 1")
                self.send("ok\n", ctype="text/plain")
            else:
                self.page("Not found", "<p>No such page.</p>")
        except ValueError:
            self.send("bad request\n", 400, "text/plain")

    def product(self, pid: int) -> None:
        rows = self.shop.q("SELECT id, name, category, price_cents, stock, description, sku FROM products "
                           "WHERE id = %s", (pid,))
        if not rows:
            self.page("Not found", "<p>No such product.</p>")
            return
        _, name, cat, price, stock, desc, sku = rows[0]
        self.page(name, f"""<p>{esc(desc)}</p><p>SKU {esc(sku)} &middot; {esc(cat)} &middot;
<span class="price">{money(price)}</span> &middot; {stock} in stock</p>
<form action="/cart/add" method="post"><input type="hidden" name="product_id" value="{pid}">
<label for="qty">Quantity</label> <input id="qty" name="qty" type="number" min="1" value="1">
<button id="add-to-cart" type="submit">Add to cart</button></form>""")

    def cart(self, msg: str = "") -> None:
        rows = self.shop.q("SELECT p.id, p.name, c.qty, p.price_cents FROM cart_items c JOIN products p "
                           "ON p.id = c.product_id ORDER BY p.id")
        if not rows:
            self.page("Your cart", "<p>Your cart is empty.</p>", msg)
            return
        lines = "".join(f"""<tr><td>{esc(n)}</td><td>
<form action="/cart/update" method="post"><input type="hidden" name="product_id" value="{pid}">
<label for="qty-{pid}">Quantity of {esc(n)}</label> <input id="qty-{pid}" name="qty" type="number" min="0"
value="{q}"> <button type="submit" id="update-{pid}">Update</button></form></td><td>{money(q * pr)}</td>
<td><form action="/cart/remove" method="post"><input type="hidden" name="product_id" value="{pid}">
<button type="submit" id="remove-{pid}" aria-label="Remove {esc(n)}">Remove</button></form></td></tr>"""
                        for pid, n, q, pr in rows)
        total = sum(q * pr for _, _, q, pr in rows)
        self.page("Your cart", f"""<table><tr><th>Product</th><th>Quantity</th><th>Price</th><th></th></tr>
{lines}<tr><th colspan="2">Total</th><th id="cart-total">{money(total)}</th><th></th></tr></table>
<h2>Checkout</h2><form action="/checkout" method="post">
<p><label for="ship-name">Name</label> <input id="ship-name" name="name" required></p>
<p><label for="ship-address">Address</label> <input id="ship-address" name="address" required size="40"></p>
<button id="place-order" type="submit">Place order</button></form>""", msg)

    def orders(self) -> None:
        rows = self.shop.q("SELECT id, created_at, status, total_cents FROM orders ORDER BY id DESC")
        if not rows:
            self.page("My orders", "<p>You have not placed any orders yet.</p>")
            return
        lines = "".join(f'<tr><td><a href="/orders/{i}">Order #{i}</a></td><td>{c:%Y-%m-%d %H:%M}</td>'
                        f"<td>{esc(s)}</td><td>{money(t)}</td></tr>" for i, c, s, t in rows)
        self.page("My orders", f"<table><tr><th>Order</th><th>Date</th><th>Status</th><th>Total</th></tr>"
                               f"{lines}</table>")

    def order(self, oid: int) -> None:
        head = self.shop.q("SELECT id, status, ship_name, ship_address, total_cents FROM orders WHERE id = %s",
                           (oid,))
        if not head:
            self.page("Not found", "<p>No such order.</p>")
            return
        _, status, name, addr, total = head[0]
        items = self.shop.q("SELECT p.name, i.qty, i.price_cents FROM order_items i JOIN products p "
                            "ON p.id = i.product_id WHERE i.order_id = %s ORDER BY p.id", (oid,))
        lines = "".join(f"<tr><td>{esc(n)}</td><td>{q}</td><td>{money(q * p)}</td></tr>" for n, q, p in items)
        self.page(f"Order #{oid}", f"""<p>Status: <strong id="order-status">{esc(status)}</strong></p>
<p>Ship to: {esc(name)}, {esc(addr)}</p><table><tr><th>Product</th><th>Quantity</th><th>Price</th></tr>
{lines}<tr><th colspan="2">Total</th><th id="order-total">{money(total)}</th></tr></table>""")

    def state(self) -> dict[str, Any]:
        cart = self.shop.q("SELECT p.sku, c.qty FROM cart_items c JOIN products p ON p.id = c.product_id")
        orders = self.shop.q("SELECT o.id, p.sku, i.qty FROM orders o JOIN order_items i ON i.order_id = o.id "
                             "JOIN products p ON p.id = i.product_id ORDER BY o.id, p.sku")
        out: dict[str, dict[str, int]] = {}
        for oid, sku, qty in orders:
            out.setdefault(str(oid), {})[sku] = qty
        return {"cart": dict(cart), "orders": out}

    def do_POST(self) -> None:
        path = urllib.parse.urlsplit(self.path).path
        f = self.form()
        try:
            if path == "/cart/add":
                pid, qty = int(f["product_id"]), max(1, int(f.get("qty") or 1))
                self.shop.q("INSERT INTO cart_items VALUES (%s, %s) ON CONFLICT (product_id) "
                            "DO UPDATE SET qty = cart_items.qty + EXCLUDED.qty", (pid, qty), fetch=False)
                name = self.shop.q("SELECT name FROM products WHERE id = %s", (pid,))[0][0]
                self.redirect("/cart?msg=" + urllib.parse.quote(f"Added {qty} \u00d7 {name} to your cart."))
            elif path == "/cart/update":
                pid, qty = int(f["product_id"]), int(f.get("qty") or 0)
                if qty > 0:
                    self.shop.q("UPDATE cart_items SET qty = %s WHERE product_id = %s", (qty, pid), fetch=False)
                else:
                    self.shop.q("DELETE FROM cart_items WHERE product_id = %s", (pid,), fetch=False)
                self.redirect("/cart?msg=Cart+updated.")
            elif path == "/cart/remove":
                self.shop.q("DELETE FROM cart_items WHERE product_id = %s", (int(f["product_id"]),), fetch=False)
                self.redirect("/cart?msg=Item+removed.")
            elif path == "/checkout":
                name, addr = f.get("name", "").strip(), f.get("address", "").strip()
                if not name or not addr:
                    self.cart("Please enter a name and an address.")
                    return
                try:
                    oid = self.shop.checkout(name, addr)
                except ValueError as e:
                    self.cart(f"Could not place the order: {e}.")
                    return
                self.redirect(f"/orders/{oid}")
            else:
                self.send("not found\n", 404, "text/plain")
        except (KeyError, ValueError, IndexError):
            self.send("bad request\n", 400, "text/plain")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--port", type=int, default=8080)
    ap.add_argument("--dsn", default="host=/run/postgresql dbname=shop user=postgres")
    ap.add_argument("--setup", action="store_true", help="create the schema and the catalogue, then exit")
    args = ap.parse_args()
    shop = Shop(args.dsn)
    if args.setup:
        shop.setup()
        return
    Handler.shop = shop
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), Handler)
    srv.daemon_threads = True
    print(f"serving on 127.0.0.1:{args.port}", flush=True)
    srv.serve_forever()


if __name__ == "__main__":
    main()
