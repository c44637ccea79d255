"""mock_engine."""
