"""History storage behind one interface (responses, conversations, items): not built yet."""
