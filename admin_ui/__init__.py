"""The admin web pages, mounted by the manager (shared/DESIGN.md section 6)."""
