INSERT INTO contract_format (version) VALUES (2);
